"""Container images for sandboxes, without Docker or Apptainer: a content-addressed store.

    store = ImageStore("/var/lib/rolloutd/images", max_bytes=50 << 30)
    image = store.acquire("oci:/images/debian:bookworm")   # imported once, then shared
    ...  # image.rootfs: a read-only dir to use as '/'; image.config: env, workdir, ...
    store.release(image)

Source refs (the same syntax for SandboxSpec.image, the API and the CLI):

    oci:PATH[:TAG]              an OCI image layout (or a dir holding ``oci-layout``)
    docker-archive:PATH[:NAME]  a `docker save` tar (or a file ending .tar, .tar.gz)
    sif:PATH                    a SIF file's squashfs system partition (or a file ending .sif)
    docker://REF                pulled with skopeo
    sha256:HEX, a 12+ digit prefix, or a name: an image already stored

Layers come from anywhere: unpacking never writes outside the store, drops device nodes and
setuid bits, and leaves every file owned by the daemon's user (see ``_unpack``).
"""

from .._exceptions import ImageError, ImageNotFound
from ._models import GcReport, Image, ImageConfig
from ._store import ImageStore

__all__ = ["GcReport", "Image", "ImageConfig", "ImageError", "ImageNotFound", "ImageStore"]
