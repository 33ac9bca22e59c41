"""Images as sources (``type = "image"``): a folder of images, or a list of image URLs.

An image can hold personal data (a screenshot of a customer's account, a photo), so nothing of an
image source is read or sent anywhere unless the source says ``approved = true``; an unapproved
source is named in the build summary instead. Each image is at most ``max_image_bytes`` (the
source's, else ``[index.llm] max_image_bytes``): a larger one is skipped, never sent. The bytes
go to the vision model in ``index/enrich.py``; this module only lists and reads them, one at a
time: a build holds at most ``IMAGES_HELD_BYTES`` of them (a batch, ``image_batches``) before it
sends them (800 links to one 4 MiB image held 3.6 GB read all at once).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath

from index.config import SourceConfig
from index.errors import ConfigError
from index.sources import SkippedPage
from index.sources.folder import FolderOptions, list_files, read_file
from index.sources.url import Failed, Fetched, fetch

MEDIA_TYPES = {
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".gif": "image/gif",
    ".webp": "image/webp",
}
IMAGES_HELD_BYTES = 64 * 1024 * 1024  # an image source's images read before they are sent
FETCH_DEADLINE_S = 60.0  # an image URL's whole request, connect to last byte
NOT_APPROVED = (
    "not sent to a model: images can hold personal data; set approved = true on the source "
    "once someone has checked them"
)


@dataclass(frozen=True, slots=True)
class ImageFile:
    path: str  # relative to the folder, or the URL: the page's source path
    data: bytes
    media_type: str
    url: str = ""


def image_limit(source: SourceConfig, default: int) -> int:
    value: int = source.options.get("max_image_bytes", default)  # in range (check_options)
    return value


def load_images(source: SourceConfig, limit: int) -> Iterator[ImageFile | SkippedPage]:
    """The images of an approved source, each at most ``limit`` bytes, read as they are taken;
    nothing of another. Raises ConfigError (at the first) for a source that cannot be read."""
    if source.options.get("approved") is not True:
        yield SkippedPage(source.name, NOT_APPROVED)
        return
    if source.path is not None:
        yield from _folder(source, limit)
        return
    urls: list[str] = source.options["urls"]  # check_options: urls, a list of strings, or a path
    if not all(urls):
        raise ConfigError(f"source {source.name!r}: urls must be a list of image URLs")
    yield from (_fetch(url, limit) for url in urls)


def image_batches(
    got: Iterable[ImageFile | SkippedPage], held: int = 0
) -> Iterator[tuple[list[ImageFile], list[SkippedPage]]]:
    """``got`` in batches of images of at most ``held`` bytes (``IMAGES_HELD_BYTES`` by
    default; one image at least), each with the images skipped while it was read."""
    held = held or IMAGES_HELD_BYTES
    images: list[ImageFile] = []
    skipped: list[SkippedPage] = []
    size = 0
    for item in got:
        if isinstance(item, SkippedPage):
            skipped.append(item)
            continue
        if images and size + len(item.data) > held:
            yield images, skipped
            images, skipped, size = [], [], 0
        images.append(item)
        size += len(item.data)
    if images or skipped:
        yield images, skipped


def _folder(source: SourceConfig, limit: int) -> Iterator[ImageFile | SkippedPage]:
    assert source.path is not None
    if not source.path.is_dir():
        raise ConfigError(f"source {source.name!r}: {source.path} is not a folder")
    follow = FolderOptions.from_options(
        source.name, {"follow_symlinks": source.options.get("follow_symlinks", False)}, limit
    ).follow_symlinks
    listing = list_files(source.path, tuple(MEDIA_TYPES), follow_symlinks=follow)
    yield from listing.skipped
    for rel, path in listing.files:
        data = read_file(rel, path, limit)
        if isinstance(data, SkippedPage):
            yield data
        else:
            yield ImageFile(rel, data, MEDIA_TYPES[PurePosixPath(rel).suffix.lower()])


def _fetch(url: str, limit: int) -> ImageFile | SkippedPage:
    """One image URL, fetched as a ``url`` source fetches a page (the whole request within its
    deadline, redirects to http(s) only), its body at most ``limit`` bytes."""
    if not url.startswith(("http://", "https://")):
        return SkippedPage(url, "not an http(s) URL")
    got = fetch(url, None, deadline_s=FETCH_DEADLINE_S, max_bytes=limit)
    if not isinstance(got, Fetched):  # Failed (a 304 needs an ETag, and none is sent)
        reason = got.reason if isinstance(got, Failed) else "no body (HTTP 304)"
        return SkippedPage(url, reason)
    suffix = PurePosixPath(url.split("?", 1)[0]).suffix.lower()
    media = got.content_type
    media = media if media in MEDIA_TYPES.values() else MEDIA_TYPES.get(suffix, "")
    if not media:
        return SkippedPage(url, "not an image (png, jpeg, gif or webp)")
    return ImageFile(url, got.body, media, url=url)
