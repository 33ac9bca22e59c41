"""Images as sources (``type = "image"``): a folder of images, or a list of image URLs.

An image can hold personal data (a screenshot of a customer's account, a photo), so nothing of an
image source is read or sent anywhere unless the source says ``approved = true``; an unapproved
source is named in the build summary instead. Each image is at most ``max_image_bytes`` (the
source's, else ``[index.llm] max_image_bytes``): a larger one is skipped, never sent. The bytes
go to the vision model in ``index/enrich.py``; this module only lists and reads them.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import PurePosixPath

from index.config import SourceConfig
from index.errors import ConfigError
from index.sources import SkippedPage
from index.sources.folder import FolderOptions, list_files, read_file, too_large

MEDIA_TYPES = {
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".gif": "image/gif",
    ".webp": "image/webp",
}
FETCH_TIMEOUT_S = 30.0  # per connect and per read of one image URL
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


def load_images(source: SourceConfig, limit: int) -> tuple[list[ImageFile], list[SkippedPage]]:
    """The images of an approved source, each at most ``limit`` bytes; nothing of another."""
    if source.options.get("approved") is not True:
        return [], [SkippedPage(source.name, NOT_APPROVED)]
    if source.path is not None:
        return _folder(source, limit)
    urls: list[str] = source.options["urls"]  # check_options: urls, a list of strings, or a path
    if not all(urls):
        raise ConfigError(f"source {source.name!r}: urls must be a list of image URLs")
    return _urls(urls, limit)


def _folder(source: SourceConfig, limit: int) -> tuple[list[ImageFile], list[SkippedPage]]:
    assert source.path is not None
    if not source.path.is_dir():
        raise ConfigError(f"source {source.name!r}: {source.path} is not a folder")
    follow = FolderOptions.from_options(
        source.name, {"follow_symlinks": source.options.get("follow_symlinks", False)}, limit
    ).follow_symlinks
    listing = list_files(source.path, tuple(MEDIA_TYPES), follow_symlinks=follow)
    images: list[ImageFile] = []
    skipped = list(listing.skipped)
    for rel, path in listing.files:
        data = read_file(rel, path, limit)
        if isinstance(data, SkippedPage):
            skipped.append(data)
            continue
        images.append(ImageFile(rel, data, MEDIA_TYPES[PurePosixPath(rel).suffix.lower()]))
    return images, skipped


def _urls(urls: list[str], limit: int) -> tuple[list[ImageFile], list[SkippedPage]]:
    images: list[ImageFile] = []
    skipped: list[SkippedPage] = []
    for url in urls:
        got = _fetch(url, limit)
        if isinstance(got, SkippedPage):
            skipped.append(got)
        else:
            images.append(got)
    return images, skipped


def _fetch(url: str, limit: int) -> ImageFile | SkippedPage:
    if not url.startswith(("http://", "https://")):
        return SkippedPage(url, "not an http(s) URL")
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:
            body = response.read(limit + 1)
            media = response.headers.get_content_type()
    except urllib.error.HTTPError as exc:
        exc.close()
        return SkippedPage(url, f"HTTP {exc.code} {exc.reason}")
    except (urllib.error.URLError, TimeoutError, OSError, ValueError) as exc:
        return SkippedPage(url, f"cannot fetch: {exc}")
    if len(body) > limit:
        return SkippedPage(url, too_large(len(body), limit))
    suffix = PurePosixPath(url.split("?", 1)[0]).suffix.lower()
    media = media if media in MEDIA_TYPES.values() else MEDIA_TYPES.get(suffix, "")
    if not media:
        return SkippedPage(url, "not an image (png, jpeg, gif or webp)")
    return ImageFile(url, body, media, url=url)
