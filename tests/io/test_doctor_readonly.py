"""`infinity doctor` on a swap directory that exists on a read-only mount says it is
read-only (EROFS) and how to check the mount, not "create the swap directory"."""
import os
import subprocess

import pytest

from infinity.io import doctor_checks


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs read-only needs root")
def test_doctor_on_a_read_only_mount_says_so(mount_tmpfs):
    mnt = mount_tmpfs("16m")
    swap = mnt / "swap"
    swap.mkdir()
    r = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot remount read-only here: {r.stderr.strip()}")
    for path in (swap, swap / "not-yet"):    # the directory, and one to be created inside it
        odirect = doctor_checks(str(path))[2]
        assert odirect["name"] == "O_DIRECT" and not odirect["ok"]
        assert "read-only file system (EROFS)" in odirect["detail"], odirect
        assert f"findmnt -T {swap}" in odirect["fix"], odirect
        assert "create the swap directory" not in odirect["fix"]
        assert "not a writable directory" not in odirect["detail"]
