"""Outputs with the user's permissions: what jaxpar writes under a temporary name and then renames
into place (a Hugging Face folder, a prepared dataset, a run directory, a planner's config).

`tempfile.mkdtemp` makes a folder 0700 and `mkstemp` a file 0600, and some writers (safetensors)
create their files 0600 too; a file renamed into place keeps that mode, so an output would be
unreadable to the user's group whatever the umask says. `apply_umask` gives a temporary file or
folder (and everything under it) the modes `open` and `os.makedirs` would have: 0666 (files) or
0777 (folders, and files with an execute bit) less the umask, e.g. 0644 / 0755 under umask 022.

Imports nothing of jaxpar, so any module may use it.
"""

from __future__ import annotations

import os

__all__ = ["umask", "apply_umask", "publish"]


def umask() -> int:
    """The process's umask (read from /proc where it can be, without changing it even briefly)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _mode(path: str, is_dir: bool, mask: int) -> int:
    if is_dir or os.stat(path).st_mode & 0o111:
        return 0o777 & ~mask
    return 0o666 & ~mask


def apply_umask(path: str) -> None:
    """Give the file or folder `path`, and everything under a folder, the modes the umask implies
    (symbolic links are left alone)."""
    mask = umask()
    if os.path.islink(path):
        return
    if not os.path.isdir(path):
        os.chmod(path, _mode(path, False, mask))
        return
    os.chmod(path, _mode(path, True, mask))
    for root, dirs, names in os.walk(path):
        for d in dirs:
            p = os.path.join(root, d)
            if not os.path.islink(p):
                os.chmod(p, _mode(p, True, mask))
        for n in names:
            p = os.path.join(root, n)
            if not os.path.islink(p):
                os.chmod(p, _mode(p, False, mask))


def publish(tmp: str, target: str) -> None:
    """Rename the finished temporary file or folder `tmp` (in `target`'s folder) to `target`, after
    `apply_umask`: a file replaces one of that name, a folder only a missing or empty one."""
    apply_umask(tmp)
    os.replace(tmp, target)
