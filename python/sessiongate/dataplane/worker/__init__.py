"""A session worker process: its channel loop, its local and TCP entry points."""
