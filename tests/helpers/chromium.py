"""Headless Chromium driven over the DevTools protocol (aiohttp's websocket client), for the report page test.

Chromium comes from Debian's `chromium` package, which `scripts/setup.sh test` installs where it can (root with
apt-get); tests skip, saying so, only where it is missing.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

import aiohttp

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-port=0",
    "--window-size=1280,1000",
]


def available() -> bool:
    return os.access(CHROMIUM, os.X_OK)


class Page:
    """One tab: `await page.call(method, **params)`; console errors and uncaught exceptions gather in `errors`."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.errors: list[str] = []
        self.pending: dict[int, asyncio.Future] = {}
        self.loaded = asyncio.Event()
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            data = json.loads(msg.data)
            if "id" in data and data["id"] in self.pending:
                self.pending.pop(data["id"]).set_result(data)
            method, params = data.get("method"), data.get("params", {})
            if method == "Runtime.exceptionThrown":
                d = params["exceptionDetails"]
                self.errors.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                self.errors.append(
                    "console: " + " ".join(str(a.get("value", a.get("description"))) for a in params.get("args", []))
                )
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                self.errors.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}")
            elif method == "Page.loadEventFired":
                self.loaded.set()

    async def call(self, method: str, **params: Any) -> dict:
        i = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[i] = fut
        await self.ws.send_json({"id": i, "method": method, "params": params})
        reply = await asyncio.wait_for(fut, 60)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    async def js(self, expression: str) -> Any:
        """The value of `expression` (awaited when it is a promise); a thrown error raises."""
        r = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression!r} threw: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def goto(self, url: str) -> None:
        self.loaded.clear()
        await self.call("Page.navigate", url=url)
        await asyncio.wait_for(self.loaded.wait(), 60)

    async def screenshot(self) -> bytes:
        return base64.b64decode((await self.call("Page.captureScreenshot", format="png"))["data"])


class Browser:
    """`async with Browser() as page:` a fresh headless Chromium with its own profile, stopped at the end."""

    async def __aenter__(self) -> Page:
        self.profile = tempfile.mkdtemp(prefix="lichen-chromium-")
        self.proc = subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "TMPDIR": self.profile},  # its own temp files go where its profile goes (removed)
        )
        port_file = os.path.join(self.profile, "DevToolsActivePort")
        deadline = time.monotonic() + 60
        while not (os.path.exists(port_file) and open(port_file).read().count("\n") >= 1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start (exit code {self.proc.poll()})")
            await asyncio.sleep(0.1)
        port = int(open(port_file).read().split()[0])
        self.session = aiohttp.ClientSession()
        async with self.session.get(f"http://127.0.0.1:{port}/json/list") as r:
            target = next(t for t in await r.json() if t["type"] == "page")
        self.ws = await self.session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
        page = Page(self.ws)
        for domain in ("Page", "Runtime", "Log"):
            await page.call(f"{domain}.enable")
        self.page = page
        return page

    async def __aexit__(self, *exc: object) -> None:
        self.page.reader.cancel()
        await self.ws.close()
        await self.session.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)
