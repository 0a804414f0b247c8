"""Images as a request gives them: data: URLs and base64 blocks decoded to bytes, the bytes decoded by Pillow, each
checked against the server's limits before it is decoded whole (a decompression bomb is refused from its header).

Nothing here imports torch or the model side: it runs in the HTTP front end, on a worker thread."""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass

from lmport.errors import ConfigError

# The formats a request may send; Pillow reads them all.
MEDIA_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")
PILLOW_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)", re.DOTALL)


class ImageError(ValueError):
    """An image a request cannot be served with; the message names the problem and what to send instead, ``param``
    the request's field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ImageLimits:
    """What one request may send: bytes of one encoded image, pixels (width x height) of one image, and images;
    the hosts whose http(s) image URLs the server fetches (none: it fetches nothing) and how long one fetch may
    take (lmport.multimodal.fetch)."""
    max_bytes: int = 10 * 2**20
    max_pixels: int = 4096 * 4096
    max_images: int = 8
    allowed_media_domains: frozenset[str] = frozenset()
    fetch_timeout: float = 5.0

    def __post_init__(self):
        for name in ("max_bytes", "max_pixels", "max_images", "fetch_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or (
                    name != "fetch_timeout" and not isinstance(value, int)):
                raise ConfigError(f"image limits: {name} must be a positive number, got {value!r}")
        if isinstance(self.allowed_media_domains, str):
            raise ConfigError("image limits: allowed_media_domains is a set of host names, not one string")
        hosts = frozenset(host.strip().lower().strip("[]").rstrip(".") for host in self.allowed_media_domains)
        for host in hosts:
            if not host or any(c in host for c in "/@?#\\ \t"):
                raise ConfigError(f"allowed media domains: {host!r} is not a host name; give names such as "
                                  f"images.example.com (no scheme, path or port)")
        object.__setattr__(self, "allowed_media_domains", hosts)

    def body_bytes(self) -> int:
        """The request-body bytes that ``max_images`` images of ``max_bytes`` each take as base64 data: URLs."""
        return self.max_images * 4 * -(-self.max_bytes // 3)


def is_http_url(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


def not_fetched(where: str) -> ImageError:
    """The refusal of an http(s) image URL by a server that fetches none."""
    return ImageError(f"{where}: this server does not fetch images from URLs; send the image itself as a data: URL "
                      f"(data:image/png;base64,...)", where)


def data_url_bytes(url: str, where: str) -> bytes:
    """The image bytes of a ``data:image/...;base64,...`` URL; an http(s) URL or anything else is an ImageError."""
    if is_http_url(url):
        raise not_fetched(where)
    match = _DATA_URL.fullmatch(url)
    if match is None:
        raise ImageError(f"{where}: not a base64 data: URL; send data:image/png;base64,... (or image/jpeg, "
                         f"image/webp, image/gif)", where)
    return base64_bytes(match["data"], match["mime"] or "", where)


def base64_bytes(data: str, media_type: str, where: str) -> bytes:
    """The bytes of base64 ``data`` said to be of ``media_type``."""
    if media_type not in MEDIA_TYPES:
        raise ImageError(f"{where}: media type {media_type or '(none)'!r} is not an image this server reads; send "
                         f"one of {', '.join(MEDIA_TYPES)}", where)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{where}: the image data is not valid base64", where) from None


def check_count(count: int, limits: ImageLimits, where: str) -> None:
    if count > limits.max_images:
        raise ImageError(f"{where}: {count} images is more than the server's limit of {limits.max_images} a request; "
                         f"send fewer", where)


def decode(data: bytes, limits: ImageLimits, where: str):
    """The image as an RGB Pillow image; ImageError for bytes that are too many, not an image, or too many pixels
    (checked from the header, before the pixels are decoded)."""
    from PIL import Image, UnidentifiedImageError
    if len(data) > limits.max_bytes:
        raise ImageError(f"{where}: {len(data)} bytes is more than the server's limit of {limits.max_bytes} an "
                         f"image; send a smaller one", where)
    try:
        image = Image.open(io.BytesIO(data), formats=PILLOW_FORMATS)
    except UnidentifiedImageError:
        raise ImageError(f"{where}: the data is not an image Pillow can read (PNG, JPEG, WebP or GIF)",
                         where) from None
    except Image.DecompressionBombError:   # Pillow's own bound, far above ours, refused from the header alike
        raise ImageError(f"{where}: the image has more pixels than the server's limit of {limits.max_pixels}; "
                         f"send a smaller image", where) from None
    width, height = image.size
    if width < 1 or height < 1 or width * height > limits.max_pixels:
        raise ImageError(f"{where}: a {width}x{height} image is more than the server's limit of "
                         f"{limits.max_pixels} pixels; send a smaller image", where)
    try:
        image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError(f"{where}: the image is corrupt ({exc}); send a complete PNG, JPEG, WebP or GIF",
                         where) from None
    return image.convert("RGB")


def digest(data: bytes) -> str:
    """A stable name of an image's bytes (the prefix cache keys a prompt's images by it)."""
    return hashlib.blake2b(data, digest_size=16, person=b"lmport-image").hexdigest()
