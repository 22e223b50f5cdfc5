"""The chat page: GET / and its script, style sheet and icon, shipped in tornchat/web/.

The page and its files are open (like /health): they hold no data. The API
calls the page makes carry the key the user types in; the page only learns
which scheme to ask for. Every reply forbids loading anything from another
origin and any inline script, so model text that slipped into markup could
still run nothing.
"""
from importlib import resources

from tornado.web import HTTPError

from tornchat import MODEL_ID
from tornchat.config import Config
from tornchat.server.handlers import BaseHandler

CONTENT_SECURITY_POLICY = "; ".join((
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "connect-src 'self'",
    "img-src 'self'",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
))
ASSETS = {  # name under /web/ -> content type
    "chat.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
    "icon.svg": "image/svg+xml",
}


def read(name: str) -> bytes:
    return resources.files("tornchat").joinpath("web", name).read_bytes()


def auth_scheme(config: Config) -> str:
    """What the page asks the user for: a Bearer key if one is configured, else user:password, else nothing."""
    if config.api_key:
        return "bearer"
    return "basic" if config.api_auth else "none"


def page(config: Config) -> bytes:
    html = read("index.html").decode()
    return html.replace("{{auth}}", auth_scheme(config)).replace("{{model}}", MODEL_ID).encode()


class WebHandler(BaseHandler):
    open_access = True

    def set_default_headers(self) -> None:
        super().set_default_headers()
        self.set_header("Content-Security-Policy", CONTENT_SECURITY_POLICY)
        self.set_header("X-Content-Type-Options", "nosniff")
        self.set_header("Referrer-Policy", "no-referrer")
        self.set_header("Cache-Control", "no-cache")  # an upgraded server serves its own page at once


class PageHandler(WebHandler):
    def get(self) -> None:
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.write(page(self.config))


class AssetHandler(WebHandler):
    def get(self, name: str) -> None:
        if name not in ASSETS:
            raise HTTPError(404)
        self.set_header("Content-Type", ASSETS[name])
        self.write(read(name))
