"""Launching: forked local workers (`launcher`), a worker's entry point (`worker`), the board of
which action each rank is in (`board`), cgroup CPU quotas (`cpu_quota`), devices and start
methods (`devices`), and the checks of a command before any worker starts (`preflight`)."""
