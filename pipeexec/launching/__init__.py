"""Launching, the floor every room may stand on: forked local workers (`launcher`), the board of
which action each rank is in (`board`), cgroup CPU quotas (`cpu_quota`), devices and start
methods (`devices`). It imports nothing of pipeexec's; what a worker runs is `pipeexec.run`'s."""
