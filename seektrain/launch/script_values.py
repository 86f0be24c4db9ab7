"""The checks every value passes before a launcher writes it into a script or a manifest.

Why one place: a generated file is code (bash reads the sbatch script, the cluster reads the manifest),
and a value typed by a user, or read from a shared config, must never become more of it. Quoting is not
enough everywhere: ``shlex.quote`` does not protect a ``#`` comment line (a newline ends it), sbatch reads
``#SBATCH`` lines with its own rules (double quotes and backslashes only, ``#`` starts a comment, ``%``
is a file-name pattern), and pyxis splits its mount list on ``,`` and ``:``. So values that land in those
places are held to a small safe character set, and everything else is quoted for its language. A value
that cannot be written safely is refused with one line naming the flag or key.
"""

from __future__ import annotations

import re

from seektrain.errors import UserError

# Slurm partition, account and QOS names: letters, digits, '_', '.', '-' (a partition list is
# comma-separated).
_SLURM_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_SLURM_NAMES = re.compile(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*")
# A path written into #SBATCH lines, comments and pyxis mounts: no space, quote, '#', '%', ',', ':',
# backslash or control character.
_SAFE_PATH = re.compile(r"/[A-Za-z0-9_./+=@~-]*")

# The OCI image reference grammar (github.com/distribution/reference, reference.go):
#   reference := name [ ":" tag ] [ "@" digest ];  name := [domain "/"] path-component ["/" path-component]*
_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[_.]|__|-+)"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[0-9A-Fa-f:.]+\])(?::[0-9]+)?"
_REMOTE = rf"{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_OCI = re.compile(rf"(?:{_DOMAIN}/)?{_REMOTE}(?::{_TAG})?(?:@{_DIGEST})?", re.ASCII)
# enroot/pyxis also name a registry as REGISTRY#IMAGE (nvcr.io#nvidia/pytorch:24.05-py3)
_ENROOT = re.compile(rf"(?:{_DOMAIN}#){_REMOTE}(?::{_TAG})?(?:@{_DIGEST})?", re.ASCII)

# Kubernetes object names (apimachinery validation): a DNS-1123 label, or a subdomain of labels
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_LABEL = re.compile(_DNS_LABEL)
DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")


def slurm_name(flag: str, value: str, several: bool = False) -> str:
    """A partition or account name, safe inside an ``#SBATCH`` line."""
    if value and not (_SLURM_NAMES if several else _SLURM_NAME).fullmatch(value):
        list_note = " (several: comma-separated)" if several else ""
        raise UserError(
            f"{flag} {value!r} is not a Slurm name: use letters, digits, '_', '.' and '-'{list_note}"
        )
    return value


def oci_image(flag: str, value: str, enroot: bool = False) -> str:
    """An image reference (``registry/path:tag@digest``); with ``enroot`` also ``registry#path:tag``."""
    if _OCI.fullmatch(value) or (enroot and _ENROOT.fullmatch(value)):
        return value
    raise UserError(
        f"{flag} {value!r} is not an image reference: use [REGISTRY/]NAME[:TAG][@DIGEST] with a lowercase "
        "name, e.g. nvcr.io/nvidia/pytorch:24.05-py3"
    )


def script_path(what: str, path: str) -> str:
    """An absolute path written into ``#SBATCH`` lines, comments and pyxis mounts."""
    if not _SAFE_PATH.fullmatch(path):
        raise UserError(
            f"{what} {path!r} cannot be written safely into the sbatch script; use an absolute path of "
            "letters, digits and . _ - / + = @ ~ only (no spaces, quotes, '#', '%', ',', ':' or newlines)"
        )
    return path


def printable(what: str, value: str) -> str:
    """A value shown on a comment line: no newline or other control character may end the comment."""
    if not value.isprintable():
        raise UserError(
            f"{what} {value!r} holds a newline or another control character, which cannot be written "
            "safely into a generated script; remove it"
        )
    return value
