"""``--weights-root``: the only directories ``/update_weights_from_disk`` may load.

Paths are compared after ``os.path.realpath`` (symlinks and ``..`` resolved), and the
files of the directory are checked too, so a link inside the root cannot point out of it.
The scheduler is handed the resolved path, so a link swapped after the check is not
followed.
"""

from __future__ import annotations

import os

from radixlm.runtime.managers.api_error import ApiError

FLAG = "--weights-root"


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def resolve_under_root(model_path: str, root: str | None) -> str:
    """``model_path`` (unchanged when ``root`` is None), else its real path: 403 when it or
    one of its files lies outside ``root``, 400 when it is not a directory."""
    if root is None:
        return model_path
    real_root, real = os.path.realpath(root), os.path.realpath(model_path)
    if not _inside(real, real_root):
        raise ApiError(403, f"model_path {model_path!r} is outside {FLAG} (weights load only "
                       f"from directories under it)", "permission_error", param="model_path",
                       code="outside_weights_root")
    if not os.path.isdir(real):
        raise ApiError(400, f"model_path {model_path!r} is not a directory under {FLAG}",
                       param="model_path")
    try:
        outside = [e.name for e in os.scandir(real)
                   if not _inside(os.path.realpath(e.path), real_root)]
    except OSError as e:
        raise ApiError(400, f"model_path {model_path!r} cannot be read: {e.strerror}",
                       param="model_path") from None
    if outside:
        raise ApiError(403, f"model_path {model_path!r} holds {outside[0]!r}, a link out of "
                       f"{FLAG}", "permission_error", param="model_path",
                       code="outside_weights_root")
    return real
