"""The server: assembles the layers into a running filesystem. No layer imports it.

``stack``     opens a store and builds the layers on it, bottom to top
``daemon``    serves a stack through FUSE: mount, signals, the control file, unmount
``fsck``      checks (and repairs) a store offline, through the same layers
``metrics``   the Prometheus text exposition of every layer's statistics
``opsstats``  per-operation counts and latencies of the FUSE handlers
``sdnotify``  systemd's readiness and watchdog protocol
"""
