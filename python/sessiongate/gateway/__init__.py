"""The gateway shell: what every layout answers the same way, over where its sessions are."""
