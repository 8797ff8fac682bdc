"""Image references in requests → image sources, with the reference's URL checks.

Accepts `data:` URLs with base64 bodies and http(s) URLs (spec §6.1, §15.9).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypeVar

from deepwell.recipe.conversation import DataUrlImageSource, ImageSource, Message, UrlImageSource
from deepwell.recipe.conversion import ConversionOptions
from deepwell.recipe.encoding.special_tokens import SpecialToken
from deepwell.recipe.errors import ConversionError
from deepwell.recipe.options import ModelVersion

UNSUPPORTED_IMAGE = (
    "You have uploaded an unsupported image. Please make sure your image is valid and has "
    "one of the following formats: webp, png, jpeg, and gif."
)
_IMAGE_MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/gif", "image/webp")
_BASE64_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_BASE64_SYMBOLS = re.compile(r"[A-Za-z0-9+/]*")
M = TypeVar("M", bound=Message)
# V4-Pro has no vision: images become this text and carry no source (spec §15.9).
UNSUPPORTED_IMAGE_TEXT = "[Unsupported Image]"


@dataclass(frozen=True)
class ImagePolicy:
    """How the target model takes images: placeholders with sources, or a text stand-in."""

    token: str
    supported: bool
    # deepwell's extension (ConversionOptions.local_image_files): `file://` URLs are image
    # sources too; the server decides which paths it reads.
    local_files: bool = False

    @classmethod
    def for_model(cls, version: ModelVersion, options: ConversionOptions) -> ImagePolicy:
        supported = options.images_supported
        if supported is None:
            supported = version is not ModelVersion.DeepseekV4Pro
        return cls(
            options.special_tokens.token(SpecialToken.Image), supported, options.local_image_files
        )


class BlockText:
    """The text of a block list joined by blank lines, knowing where its image placeholders
    are (a user-typed look-alike before them stays text)."""

    def __init__(self, images: ImagePolicy) -> None:
        self.images = images
        self.parts: list[str] = []
        self.sources: list[ImageSource] = []
        self._image_parts: list[int] = []

    def text(self, text: str) -> None:
        self.parts.append(text)

    def image(self, source: ImageSource) -> None:
        self._image_parts.append(len(self.parts))
        self.parts.append(self.images.token)
        self.sources.append(source)

    def content(self) -> str:
        return "\n\n".join(self.parts)

    def attach(self, message: M) -> M:
        """Give `message` (built from `content()` and `sources`) the placeholder positions."""
        spans = []
        offset = 0
        for index, part in enumerate(self.parts):
            if index in self._image_parts:
                spans.append((offset, offset + len(part)))
            offset += len(part) + 2
        message.image_spans = tuple(spans)
        return message


def image_source(url: str, detail: str | None, path: str, images: ImagePolicy) -> ImageSource:
    """An image URL as a source; `path` names the request part in error messages."""
    detail = detail or "high"
    lowered = url.lower()
    if lowered.startswith(("http://", "https://")) or (
        images.local_files and lowered.startswith("file://")
    ):
        return UrlImageSource(url, detail, path=path)
    if lowered.startswith("data:"):
        check_data_url(url, path)
        return DataUrlImageSource(url, detail, path=path)
    raise ConversionError(f"{path}: Unsupported image_url format")


def check_data_url(url: str, path: str) -> None:
    header, comma, body = url[len("data:") :].partition(",")
    if not comma or not header.endswith(";base64"):
        # Percent-encoded (non-base64) data URLs are refused outright (spec §15.9).
        raise ConversionError(f"{path}: Unsupported image_url format")
    media_type = header.split(";", 1)[0].lower()
    if media_type not in _IMAGE_MEDIA_TYPES:
        raise ConversionError(f"{path}: {UNSUPPORTED_IMAGE}")
    check_base64(body, path)


UNSUPPORTED_FILE = (
    "You have uploaded an unsupported file. Please make sure your file is valid and has "
    "one of the following formats: webp, png, jpeg, and gif."
)


def check_file_data(data: str, path: str) -> None:
    """A Chat `file` block's `file_data`: a data URL of an image, base64 bodies decodable.

    (A data URL not marked `;base64` passes here and is refused as an image URL later.)
    """
    header, comma, body = data.partition(",")
    if not header.lower().startswith("data:") or not comma:
        raise ConversionError(f"{path}: file_data is not a valid base64 data url")
    if header[len("data:") :].split(";", 1)[0].lower() not in _IMAGE_MEDIA_TYPES:
        raise ConversionError(f"{path}: {UNSUPPORTED_FILE}")
    if header.endswith(";base64") and not lenient_base64(body):
        raise ConversionError(f"{path}: file_data is not a valid base64 data url")


def check_base64(body: str, path: str) -> None:
    if not lenient_base64(body):
        raise ConversionError(f"{path}: Invalid base64 data")


def lenient_base64(text: str) -> bool:
    """Data-URL bodies: whitespace skipped, padding optional but exact when given."""
    compact = "".join(text.split())
    core = compact.rstrip("=")
    padding = len(compact) - len(core)
    if not _BASE64_SYMBOLS.fullmatch(core) or len(core) % 4 == 1:
        return False
    return padding == 0 or padding == (4 - len(core) % 4) % 4 != 0


def padded_base64(text: str) -> bool:
    """Messages image data: padding required (extra allowed), unused trailing bits zero."""
    core = text.rstrip("=")
    padding = len(text) - len(core)
    if not _BASE64_SYMBOLS.fullmatch(core) or len(core) % 4 == 1:
        return False
    rest = len(core) % 4
    if rest and padding < 4 - rest:
        return False
    if not rest:
        return True
    # The last symbol carries 4 (two symbols left) or 2 (three left) bits nobody reads.
    unused = 0b1111 if rest == 2 else 0b11
    return _BASE64_ALPHABET.index(core[-1]) & unused == 0
