"""Images fetched from http(s) URLs, only from the hosts the server was started with (``--allowed-media-domains``).

A server that fetches any URL a request names is a proxy into whatever network it sits in, so fetching is off
unless the operator lists hosts; then a URL's host must be one of them (an exact host name, any port), and so must
every host a redirect leads to. One fetch takes at most ``fetch_timeout`` seconds in all and reads at most the
per-image byte limit (counted as the body arrives; the rest is never read), asked for and taken uncompressed only,
so that nothing grows after it is counted. The fetch is asynchronous: it waits on the network without holding the
event loop or the tokenizing thread.
"""
from __future__ import annotations

import asyncio
import functools
import ssl

import certifi
import httpx

from lmport.multimodal.images import ImageError, ImageLimits, not_fetched

MAX_REDIRECTS = 5
SCHEMES = ("http", "https")
# Images come compressed already; an uncompressed reply is counted as it arrives, with no expansion after the count.
HEADERS = {"Accept": "image/*, */*;q=0.5", "Accept-Encoding": "identity"}


def allowed_url(url: str, limits: ImageLimits, where: str) -> httpx.URL:
    """``url`` parsed as it will be fetched, or an ImageError: fetching is off, the URL is not http(s), or its host
    is not one the server fetches from."""
    if not limits.allowed_media_domains:
        raise not_fetched(where)
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ImageError(f"{where}: not a valid URL ({exc}); send an http(s) URL or a data: URL", where) from None
    if parsed.scheme not in SCHEMES or not parsed.host:
        raise ImageError(f"{where}: only http and https image URLs are fetched; send one, or a data: URL", where)
    if not _host_allowed(parsed, limits):
        raise ImageError(f"{where}: host {parsed.host!r} is not one this server fetches images from "
                         f"(--allowed-media-domains); send the image itself as a data: URL", where)
    return parsed


def _host_allowed(url: httpx.URL, limits: ImageLimits) -> bool:
    # An internationalised name matches as written or in its ASCII (punycode) form; a trailing dot is the same name.
    names = {url.host.rstrip("."), url.raw_host.decode("ascii", "replace").lower().rstrip(".")}
    return not names.isdisjoint(limits.allowed_media_domains)


async def fetch(url: str, limits: ImageLimits, where: str) -> bytes:
    """The bytes of the image at ``url``; ImageError naming its host when the URL is refused or the fetch fails."""
    target = allowed_url(url, limits, where)
    host = target.host
    try:
        return await asyncio.wait_for(_get(target, limits, where), limits.fetch_timeout)
    except (TimeoutError, asyncio.TimeoutError, httpx.TimeoutException):
        raise ImageError(f"{where}: fetching the image from host {host!r} took more than "
                         f"{limits.fetch_timeout:g} s; send the image itself as a data: URL", where) from None
    except httpx.HTTPError as exc:
        raise ImageError(f"{where}: fetching the image from host {host!r} failed ({type(exc).__name__}: "
                         f"{str(exc)[:200]}); send the image itself as a data: URL", where) from None


@functools.cache
def _tls() -> ssl.SSLContext:
    """The certificates https fetches trust (httpx's own, certifi's), loaded once: loading takes a while."""
    return ssl.create_default_context(cafile=certifi.where())


async def _get(url: httpx.URL, limits: ImageLimits, where: str) -> bytes:
    # No environment settings (proxies, .netrc credentials): the server's own secrets never go to a media host.
    async with httpx.AsyncClient(timeout=limits.fetch_timeout, follow_redirects=False, trust_env=False,
                                 verify=_tls()) as client:
        for _ in range(MAX_REDIRECTS + 1):
            async with client.stream("GET", url, headers=HEADERS) as reply:
                if reply.is_redirect and reply.next_request is not None:
                    following = reply.next_request.url
                    if following.scheme not in SCHEMES:
                        raise ImageError(f"{where}: the image URL on host {url.host!r} redirects to a "
                                         f"{following.scheme}: URL; only http and https image URLs are fetched: "
                                         f"send the image itself as a data: URL", where)
                    if not _host_allowed(following, limits):
                        raise ImageError(f"{where}: the image URL on host {url.host!r} redirects to host "
                                         f"{following.host!r}, which is not one this server fetches images from "
                                         f"(--allowed-media-domains); send the image itself as a data: URL", where)
                    url = following
                    continue
                if reply.status_code != 200:
                    raise ImageError(f"{where}: fetching the image from host {url.host!r} failed: HTTP "
                                     f"{reply.status_code}; check the URL, or send the image as a data: URL", where)
                return await _body(reply, limits, where, url.host)
        raise ImageError(f"{where}: the image URL on host {url.host!r} redirects more than {MAX_REDIRECTS} times; "
                         f"send the final URL, or the image as a data: URL", where)


async def _body(reply: httpx.Response, limits: ImageLimits, where: str, host: str) -> bytes:
    """The reply's body, read until it passes the per-image byte limit."""
    def too_big(how: str) -> ImageError:
        return ImageError(f"{where}: the image from host {host!r} is larger than the server's limit of "
                          f"{limits.max_bytes} bytes an image ({how}); send a smaller one", where)
    encoding = reply.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ImageError(f"{where}: the image from host {host!r} came with content encoding {encoding!r} though "
                         f"none was asked for; serve it as it is (Content-Encoding: identity), or send it as a data: "
                         f"URL", where)
    length = reply.headers.get("content-length", "")
    if length.isdigit() and int(length) > limits.max_bytes:
        raise too_big(f"its Content-Length is {length}")
    data = bytearray()
    async for chunk in reply.aiter_raw():
        data += chunk
        if len(data) > limits.max_bytes:   # the rest is never read
            raise too_big(f"more than {limits.max_bytes} bytes arrived")
    return bytes(data)


async def fetch_all(urls: list[tuple[str, str]], limits: ImageLimits) -> list[bytes]:
    """Each ``(url, where)`` fetched at once; the first refusal is raised and the other fetches are cancelled."""
    tasks = [asyncio.ensure_future(fetch(url, limits, where)) for url, where in urls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
