"""The RL control plane of smg 1.13 (`/v1/rl/...`): engine selection and fan-out of calls."""
