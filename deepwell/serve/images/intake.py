"""A request's images on their way to the engine: refused when the model cannot see them or
there are too many, read and preprocessed, and their placeholders expanded into spans.

Every refusal is an `ApiError` 400 whose message starts with the image's ordinal and part of
the request (`image 2 (messages[0])`), so a client knows which image to fix.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepwell.engine.multimodal import ImageInput
from deepwell.recipe import Conversation
from deepwell.recipe.conversation import ImageSource
from deepwell.serve.errors import ApiError
from deepwell.serve.images.expansion import expand_image_placeholders
from deepwell.serve.images.grid import VisionSpec
from deepwell.serve.images.media import MediaAccess
from deepwell.serve.images.pixels import PixelLimits, PreparedImage
from deepwell.serve.images.pool import ImageFault, ImagePreprocessor, PoolConfig, image_part
from deepwell.serve.settings import ImageSettings

# Response header of a model that cannot see images but answers with a stand-in text in
# their place (DeepSeek's documented behaviour for its text-only V4-Pro, spec/recipe.md
# §15.9): how many images of the request the model did not see.
IMAGES_NOT_SEEN_HEADER = "x-deepwell-images-not-seen"


def conversation_images(conversation: Conversation) -> list[ImageSource]:
    """The image sources of every message, in message order."""
    return [source for message in conversation.messages for source in message.image_sources]


class ImageIntake:
    """The served model's images: its vision spec (None: it takes none) and the limits."""

    def __init__(
        self, vision: VisionSpec | None, settings: ImageSettings, pool: PoolConfig
    ) -> None:
        self.vision = vision
        self.settings = settings
        self._preprocessor = None
        if vision is not None:
            access = MediaAccess(
                settings.allowed_media_domains,
                settings.allowed_local_media_path,
                settings.max_image_bytes,
                settings.media_fetch_timeout_s,
            )
            limits = PixelLimits(settings.max_image_bytes, settings.max_image_pixels)
            self._preprocessor = ImagePreprocessor(vision, limits, access, pool)

    def admit(self, model_name: str, sources: Sequence[ImageSource]) -> None:
        """Refuse images the model cannot see, and more images than the limit."""
        if not sources:
            return
        if self.vision is None:
            raise ApiError(
                400,
                f"{image_part(0, sources[0])}: the model {model_name} does not take images "
                "(it has no vision tower); send the request without its image parts",
                param=_param(sources[0]),
            )
        limit = self.settings.max_images_per_prompt
        if len(sources) > limit:
            raise ApiError(
                400,
                f"{image_part(limit, sources[limit])}: the request has {len(sources)} images, "
                f"more than the limit of {limit} per request (serve --limit-mm-per-prompt "
                "image=N)",
                param=_param(sources[limit]),
            )

    def prepare(self, sources: Sequence[ImageSource]) -> list[PreparedImage]:
        """Read, decode, resize and patch the images (admitted first); blocks."""
        if self._preprocessor is None or not sources:
            return []
        try:
            return self._preprocessor.prepare(sources)
        except ImageFault as fault:
            raise ApiError(400, str(fault), param=fault.path.lstrip(".") or None) from None

    def prompt_images(
        self, prompt_ids: list[int], placeholder_id: int, prepared: Sequence[PreparedImage]
    ) -> tuple[list[int], list[ImageInput]]:
        """The prompt with each placeholder expanded, and the images that fill the spans."""
        assert self.vision is not None  # admitted: only a vision model has images here
        expanded, offsets = expand_image_placeholders(
            prompt_ids, placeholder_id, self.vision.image_token_id, [p.grid for p in prepared]
        )
        images = [
            ImageInput(
                image.content_hash,
                (image.grid.vit_height, image.grid.vit_width),
                image.pixel_values,
                offset,
            )
            for image, offset in zip(prepared, offsets, strict=True)
        ]
        return expanded, images

    def close(self) -> None:
        if self._preprocessor is not None:
            self._preprocessor.close()


def _param(source: ImageSource) -> str | None:
    return source.path.lstrip(".") or None
