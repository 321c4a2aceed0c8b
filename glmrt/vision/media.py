"""Loading images and videos named by API requests, safely.

Sources: ``data:`` URLs (base64 or percent-encoded), local paths / ``file://`` URLs only under
``allowed_local_path`` (symlinks resolved, escapes refused), ``http(s)://`` only when
``allow_remote`` (urllib, a timeout over the whole transfer, a byte limit, redirects only to
http(s)). Every failure -- a refused source, an oversized or unreadable payload, a truncated
or corrupt image or video -- raises `MediaError` with a message naming the problem; no PIL /
PyAV / urllib exception escapes.

Images are decoded fully here (``Image.load()``), so a truncated file fails now rather than in
the middle of batching; EXIF orientation is applied and the result is RGB (as HF's
``load_image`` does). Videos are decoded with PyAV from memory, restricted to common
container formats (mp4/mov, matroska/webm, avi, gif...) so that playlist-style demuxers
(HLS, concat) cannot make FFmpeg open other files or URLs.

No torch here (this runs in the tokenizer process).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import stat
import struct
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from typing import Any

import numpy as np

__all__ = ["MediaError", "fetch_media_bytes", "load_image", "load_video", "decode_image", "decode_video"]

DEFAULT_MAX_BYTES = 32 << 20
DEFAULT_TIMEOUT = 10.0
# Pillow's own decompression-bomb threshold (~89.5 MP); checked before decoding.
DEFAULT_MAX_PIXELS = 89_478_485
DEFAULT_MAX_DECODED_BYTES = 2 << 30
_VIDEO_FORMATS = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,gif,mpeg,mpegts,flv,ogg"


class MediaError(ValueError):
    """A media item of a request cannot be used; the message says why (safe to show a client)."""


# --------------------------------------------------------------------------------------------
# Bytes
# --------------------------------------------------------------------------------------------

def _short(source: str, n: int = 80) -> str:
    return source if len(source) <= n else source[: n - 3] + "..."


def _data_url_bytes(source: str, kind: str, max_bytes: int) -> bytes:
    head, sep, payload = source.partition(",")
    if not sep:
        raise MediaError("malformed data URL: no ',' separating the header from the data")
    params = head[5:].split(";")
    mime = params[0].strip().lower()
    if mime and not mime.startswith(kind + "/") and mime != "application/octet-stream":
        raise MediaError(f"data URL has media type {mime!r}, expected {kind}/*")
    if "base64" in (p.strip().lower() for p in params[1:]):
        payload = "".join(payload.split())
        if len(payload) * 3 // 4 > max_bytes + 3:
            raise MediaError(f"{kind} data is larger than the {max_bytes}-byte limit")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            try:  # URL-safe alphabet, padding optional
                data = base64.b64decode(payload + "=" * (-len(payload) % 4), altchars=b"-_", validate=True)
            except (binascii.Error, ValueError) as e:
                raise MediaError(f"data URL has invalid base64: {e}") from None
    else:
        if len(payload) > 3 * max_bytes + 3:
            raise MediaError(f"{kind} data is larger than the {max_bytes}-byte limit")
        data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise MediaError(f"{kind} data is {len(data)} bytes, over the {max_bytes}-byte limit")
    if not data:
        raise MediaError(f"data URL holds no {kind} data")
    return data


def _local_bytes(path: str, kind: str, allowed_local_path: str | None, max_bytes: int) -> bytes:
    if allowed_local_path is None:
        raise MediaError(f"local {kind} files are not allowed on this server")
    if "\x00" in path:
        raise MediaError("invalid local path")
    root = os.path.realpath(allowed_local_path)
    target = os.path.realpath(path if os.path.isabs(path) else os.path.join(root, path))
    try:
        inside = os.path.commonpath([root, target]) == root
    except ValueError:
        inside = False
    if not inside:
        raise MediaError(f"local {kind} path {_short(path)!r} is outside the allowed directory")
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(target, flags)
    except OSError as e:
        raise MediaError(f"cannot open local {kind} {_short(path)!r}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MediaError(f"local {kind} {_short(path)!r} is not a regular file")
        if st.st_size > max_bytes:
            raise MediaError(f"local {kind} {_short(path)!r} is {st.st_size} bytes, over the {max_bytes}-byte limit")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as f:
            fd = -1
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise MediaError(f"cannot read local {kind} {_short(path)!r}: {e.strerror or e}") from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > max_bytes:
        raise MediaError(f"local {kind} {_short(path)!r} is over the {max_bytes}-byte limit")
    if not data:
        raise MediaError(f"local {kind} {_short(path)!r} is empty")
    return data


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    max_redirections = 5

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: D401 - urllib API
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise MediaError("remote media redirected to a non-http(s) URL")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _remote_bytes(url: str, kind: str, max_bytes: int, timeout: float) -> bytes:
    opener = urllib.request.build_opener(_HttpOnlyRedirects())
    req = urllib.request.Request(url, headers={"User-Agent": "glmrt-media/1", "Accept": f"{kind}/*"})
    deadline = time.monotonic() + timeout
    try:
        with opener.open(req, timeout=timeout) as resp:
            length = resp.headers.get("Content-Length")
            if length is not None and length.strip().isdigit() and int(length) > max_bytes:
                raise MediaError(f"remote {kind} is {int(length)} bytes, over the {max_bytes}-byte limit")
            chunks, total = [], 0
            while True:
                if time.monotonic() > deadline:
                    raise MediaError(f"fetching remote {kind} took longer than {timeout:g} s")
                chunk = resp.read(min(1 << 16, max_bytes + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
                if total > max_bytes:
                    raise MediaError(f"remote {kind} is over the {max_bytes}-byte limit")
    except MediaError:
        raise
    except urllib.error.HTTPError as e:
        raise MediaError(f"fetching remote {kind} failed: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        raise MediaError(f"fetching remote {kind} failed: {e.reason}") from None
    except TimeoutError:
        raise MediaError(f"fetching remote {kind} timed out after {timeout:g} s") from None
    except (OSError, ValueError) as e:
        raise MediaError(f"fetching remote {kind} failed: {e}") from None
    data = b"".join(chunks)
    if not data:
        raise MediaError(f"remote {kind} is empty")
    return data


def fetch_media_bytes(
    source: str,
    *,
    kind: str = "image",
    allowed_local_path: str | None = None,
    allow_remote: bool = False,
    max_bytes: int = DEFAULT_MAX_BYTES,
    timeout: float = DEFAULT_TIMEOUT,
) -> bytes:
    """The raw bytes a request's media `source` names (kind: "image" or "video"), policy applied."""
    if not isinstance(source, str) or not source.strip():
        raise MediaError(f"{kind} source must be a non-empty string")
    source = source.strip()
    scheme = source.split(":", 1)[0].lower() if ":" in source[:12] else ""
    if scheme == "data":
        return _data_url_bytes(source, kind, max_bytes)
    if scheme in ("http", "https"):
        if not allow_remote:
            raise MediaError(f"remote {kind} URLs are not allowed on this server")
        return _remote_bytes(source, kind, max_bytes, timeout)
    if scheme == "file":
        parts = urllib.parse.urlsplit(source)
        if parts.netloc not in ("", "localhost"):
            raise MediaError(f"file URL with a host ({parts.netloc!r}) is not supported")
        return _local_bytes(urllib.parse.unquote(parts.path), kind, allowed_local_path, max_bytes)
    if scheme and len(scheme) > 1 and scheme.isalnum():  # some other URL scheme (ftp:, gopher: ...)
        raise MediaError(f"unsupported {kind} URL scheme {scheme!r}")
    return _local_bytes(source, kind, allowed_local_path, max_bytes)


# --------------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------------

def decode_image(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> Any:
    """Bytes -> a fully decoded RGB PIL image (EXIF orientation applied); MediaError otherwise."""
    from PIL import Image, ImageFile, ImageOps

    if ImageFile.LOAD_TRUNCATED_IMAGES:  # someone relaxed Pillow globally; we still refuse truncation
        raise MediaError("refusing to decode images while PIL.ImageFile.LOAD_TRUNCATED_IMAGES is set")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w < 1 or h < 1:
                raise MediaError(f"image has an empty size {w}x{h}")
            if w * h > max_pixels:
                raise MediaError(f"image is {w}x{h} = {w * h} pixels, over the {max_pixels}-pixel limit")
            img.load()
            img = ImageOps.exif_transpose(img)
            if img.mode != "RGB":
                img = img.convert("RGB")
            img.load()
    except MediaError:
        raise
    except Image.UnidentifiedImageError:
        raise MediaError("image data is not in a recognised image format") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise MediaError(f"image is too large: {e}") from None
    except (OSError, SyntaxError, ValueError, TypeError, EOFError, IndexError, KeyError,
            struct.error, MemoryError, ZeroDivisionError) as e:
        raise MediaError(f"image data is truncated or corrupt: {e}") from None
    return img


def load_image(
    source: str,
    *,
    allowed_local_path: str | None = None,
    allow_remote: bool = False,
    max_bytes: int = DEFAULT_MAX_BYTES,
    timeout: float = DEFAULT_TIMEOUT,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> Any:
    """The fully decoded RGB `PIL.Image.Image` a request's image source names, or MediaError."""
    data = fetch_media_bytes(source, kind="image", allowed_local_path=allowed_local_path,
                             allow_remote=allow_remote, max_bytes=max_bytes, timeout=timeout)
    return decode_image(data, max_pixels=max_pixels)


# --------------------------------------------------------------------------------------------
# Videos
# --------------------------------------------------------------------------------------------

def decode_video(
    data: bytes,
    *,
    max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> tuple[list[np.ndarray], float]:
    """Bytes -> (every frame as HxWx3 uint8 RGB, frames per second); MediaError otherwise.

    fps is the stream's average rate (what HF's PyAV reader reports), else its guessed rate,
    else frames/duration. Frames of a different size than the first are rescaled to it.
    Decoding stops with MediaError once the frames would take more than max_decoded_bytes."""
    try:
        import av
    except ImportError:  # pragma: no cover - av is a runtime dependency
        raise MediaError("video input needs PyAV (the 'av' package), which is not installed") from None

    frames: list[np.ndarray] = []
    try:
        container = av.open(io.BytesIO(data), mode="r",
                            container_options={"format_whitelist": _VIDEO_FORMATS})
    except av.FFmpegError as e:
        raise MediaError(f"video data is not a readable video container: {e}") from None
    except (OSError, ValueError, EOFError) as e:
        raise MediaError(f"video data is not a readable video container: {e}") from None
    try:
        with container:
            if not container.streams.video:
                raise MediaError("video data has no video stream")
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            size = None
            used = 0
            first_t = last_t = None
            for frame in container.decode(stream):
                t = frame.time
                if t is not None:
                    first_t = t if first_t is None else min(first_t, t)
                    last_t = t if last_t is None else max(last_t, t)
                if size is None:
                    size = (frame.width, frame.height)
                    if size[0] < 1 or size[1] < 1 or size[0] * size[1] > max_pixels:
                        raise MediaError(f"video frame size {size[0]}x{size[1]} is out of range")
                if (frame.width, frame.height) != size:
                    arr = frame.to_ndarray(format="rgb24", width=size[0], height=size[1])
                else:
                    arr = frame.to_ndarray(format="rgb24")
                used += arr.nbytes
                if used > max_decoded_bytes:
                    raise MediaError(f"video decodes to more than {max_decoded_bytes} bytes of frames "
                                     f"({len(frames)} frames so far); send a shorter or smaller clip")
                frames.append(np.ascontiguousarray(arr))
            fps = None
            for rate in (stream.average_rate, stream.guessed_rate, stream.base_rate):
                if rate is not None and float(rate) > 0:
                    fps = float(rate)
                    break
            if fps is None and frames:
                dur = None
                if stream.duration is not None and stream.time_base is not None:
                    dur = float(stream.duration * stream.time_base)
                elif container.duration:
                    dur = container.duration / 1_000_000
                if dur and dur > 0:
                    fps = len(frames) / dur
            if frames and fps:
                _check_complete(stream, container, len(frames), first_t, last_t, fps)
    except MediaError:
        raise
    except av.FFmpegError as e:
        raise MediaError(f"video data is truncated or corrupt: {e}") from None
    except (OSError, ValueError, EOFError, RuntimeError, MemoryError) as e:
        raise MediaError(f"video data is truncated or corrupt: {e}") from None
    if not frames:
        raise MediaError("video data holds no decodable frames")
    if fps is None or not np.isfinite(fps) or fps <= 0:
        raise MediaError("video has no usable frame rate")
    return frames, fps


def _check_complete(stream: Any, container: Any, n: int, first_t: float | None,
                    last_t: float | None, fps: float) -> None:
    """Refuses a clip that decoded to clearly less than its header announces (a truncated file:
    streamable containers and faststart mp4 decode their first part without any error)."""
    if stream.frames and n < 0.9 * stream.frames - 2:
        raise MediaError(f"video data is truncated: decoded {n} of {stream.frames} frames")
    if first_t is None or last_t is None:
        return
    span = last_t - first_t + 1 / fps
    if stream.duration is not None and stream.time_base is not None:
        expected, slack = float(stream.duration * stream.time_base), 0.9
    elif container.duration:
        # the container's duration also covers other streams (audio): be lenient
        expected, slack = container.duration / 1_000_000, 0.5
    else:
        return
    if expected > 0 and span < slack * expected - 2 / fps:
        raise MediaError(f"video data is truncated: decoded {span:.2f} s of {expected:.2f} s")


def load_video(
    source: str,
    *,
    allowed_local_path: str | None = None,
    allow_remote: bool = False,
    max_bytes: int = DEFAULT_MAX_BYTES * 8,
    timeout: float = DEFAULT_TIMEOUT,
    max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
) -> tuple[list[np.ndarray], float]:
    """(frames HxWx3 uint8 RGB, fps) of the video a request names (data: URL with base64
    mp4/webm/..., an allowed local file, or http(s) when allowed), or MediaError."""
    data = fetch_media_bytes(source, kind="video", allowed_local_path=allowed_local_path,
                             allow_remote=allow_remote, max_bytes=max_bytes, timeout=timeout)
    return decode_video(data, max_decoded_bytes=max_decoded_bytes)
