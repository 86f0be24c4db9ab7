"""The container image that `deploy/docker/Dockerfile` builds, named once for every launcher.

`seektrain launch k8s` (and the Slurm launcher) default `--image` to this name, so a user who builds
the image with the documented command gets manifests that run it without naming it again.
"""

from __future__ import annotations

from seektrain.version import version

# docker build -f deploy/docker/Dockerfile -t seektrain:<version> .
IMAGE_REPOSITORY = "seektrain"
DEFAULT_IMAGE = f"{IMAGE_REPOSITORY}:{version()}"
# The non-root user the image runs as (Dockerfile `useradd --uid`); pods use it as their fsGroup so
# the run volume is writable.
IMAGE_UID = 10001
