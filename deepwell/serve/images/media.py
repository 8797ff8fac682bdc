"""An image source → its bytes: data URLs, http(s) URLs from the domains the operator allows,
and local files under the directory the operator allows (serve --allowed-media-domains,
--allowed-local-media-path). Everything else is refused with how to allow it.
"""

from __future__ import annotations

import base64
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from deepwell.recipe.conversation import ImageSource
from deepwell.serve.images.pixels import ImageRejected


@dataclass(frozen=True)
class MediaAccess:
    """Where image bytes may come from, and how much and how long a fetch may take."""

    # Host names remote images may come from (exact, case-insensitive); empty: none.
    allowed_domains: tuple[str, ...] = ()
    # The directory `file://` images must lie under; None: no local files.
    allowed_local_path: Path | None = None
    max_bytes: int = 20 * 1024 * 1024
    fetch_timeout_s: float = 10.0


def image_bytes(source: ImageSource, access: MediaAccess) -> bytes:
    """The bytes of one image; ImageRejected says why not (and how to allow it)."""
    if source.data is not None:
        return _capped(source.data, access)
    if source.data_url is not None:
        return _capped(_data_url_bytes(source.data_url), access)
    url = source.url or ""
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "file":
        return _local_file(url, access)
    return _fetch(url, access)


def _capped(data: bytes, access: MediaAccess) -> bytes:
    if len(data) > access.max_bytes:
        raise ImageRejected(
            f"the image is {len(data)} bytes, more than the limit of {access.max_bytes} "
            "(serve --max-image-bytes)"
        )
    return data


def _data_url_bytes(url: str) -> bytes:
    # The recipe checked the header and the alphabet; padding may be missing.
    body = "".join(url.partition(",")[2].split())
    try:
        return base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    except ValueError:
        raise ImageRejected("the data URL's base64 body does not decode") from None


def _allowed_host(url: str, access: MediaAccess) -> None:
    parts = urllib.parse.urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.scheme.lower() not in ("http", "https"):
        raise ImageRejected(f"{url!r} is not an http(s) URL")
    allowed = {domain.lower() for domain in access.allowed_domains}
    if not allowed:
        raise ImageRejected(
            f"remote images are off: to fetch from {host}, start the server with "
            f"--allowed-media-domains {host} (or send the image as a base64 data URL)"
        )
    if host not in allowed:
        raise ImageRejected(
            f"fetching images from {host} is not allowed (allowed: {', '.join(sorted(allowed))}); "
            f"add it with --allowed-media-domains"
        )


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed host: the check runs again on every hop."""

    def __init__(self, access: MediaAccess) -> None:
        self.access = access

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ANN201
        _allowed_host(newurl, self.access)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(url: str, access: MediaAccess) -> bytes:
    _allowed_host(url, access)
    opener = urllib.request.build_opener(_CheckedRedirects(access))
    deadline = time.monotonic() + access.fetch_timeout_s
    chunks: list[bytes] = []
    size = 0
    try:
        with opener.open(url, timeout=access.fetch_timeout_s) as response:
            while chunk := response.read(64 * 1024):
                size += len(chunk)
                if size > access.max_bytes:
                    raise ImageRejected(
                        f"the image at {url} is more than the limit of {access.max_bytes} bytes "
                        "(serve --max-image-bytes)"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError
                chunks.append(chunk)
    except urllib.error.HTTPError as error:
        raise ImageRejected(f"fetching {url} failed: HTTP {error.code}") from None
    except TimeoutError:
        raise ImageRejected(
            f"fetching {url} took longer than {access.fetch_timeout_s:g} s"
        ) from None
    except (urllib.error.URLError, OSError) as error:
        raise ImageRejected(f"fetching {url} failed: {error}") from None
    return b"".join(chunks)


def _local_file(url: str, access: MediaAccess) -> bytes:
    path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
    if access.allowed_local_path is None:
        raise ImageRejected(
            "local image files are off: start the server with --allowed-local-media-path DIR "
            "to read images under DIR"
        )
    root = access.allowed_local_path.resolve()
    resolved = path.resolve()
    if not resolved.is_relative_to(root):
        raise ImageRejected(f"{path} is not under the allowed local media path {root}")
    try:
        size = resolved.stat().st_size
        if size > access.max_bytes:
            raise ImageRejected(
                f"the image is {size} bytes, more than the limit of {access.max_bytes} "
                "(serve --max-image-bytes)"
            )
        return resolved.read_bytes()
    except OSError as error:
        raise ImageRejected(f"cannot read {path}: {error.strerror}") from None
