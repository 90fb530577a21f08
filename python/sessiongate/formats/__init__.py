"""File formats sessiongate writes for trainers."""
