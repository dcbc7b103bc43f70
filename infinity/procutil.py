"""Process facts shared by the swap-directory lock and the checkpoint writer."""
import os

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (on this host)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
