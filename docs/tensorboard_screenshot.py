"""Screenshot of a TensorBoard page with headless Chromium, driven over the DevTools
protocol: outliers kept in the chart scaling (a short run has few points per curve) and
the settings pane closed. Made docs/tensorboard.png (docs/tensorboard.md).

    python docs/tensorboard_screenshot.py URL OUT.png
"""

import asyncio
import base64
import json
import subprocess
import sys
import time
import urllib.request

import websockets

URL, OUT = sys.argv[1], sys.argv[2]
PORT = 9333


async def main() -> None:
    chrome = subprocess.Popen(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--enable-unsafe-swiftshader",
            "--hide-scrollbars",
            f"--remote-debugging-port={PORT}",
            "--window-size=1500,1100",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            try:
                pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{PORT}/json"))
                page = next(p for p in pages if p["type"] == "page")
                break
            except (OSError, StopIteration):
                time.sleep(0.2)
        async with websockets.connect(page["webSocketDebuggerUrl"], max_size=2**26) as ws:
            n = 0

            async def call(method: str, **params: object) -> dict:
                nonlocal n
                n += 1
                await ws.send(json.dumps({"id": n, "method": method, "params": params}))
                while True:
                    msg = json.loads(await ws.recv())
                    if msg.get("id") == n:
                        return msg.get("result", {})

            async def js(code: str) -> object:
                r = await call("Runtime.evaluate", expression=code, returnByValue=True)
                return r.get("result", {}).get("value")

            await call(
                "Emulation.setDeviceMetricsOverride",
                width=1500,
                height=1100,
                deviceScaleFactor=1,
                mobile=False,
            )
            await call("Page.navigate", url=URL)
            await asyncio.sleep(6)
            # Keep outliers in the scaling (few points per curve), then close the pane.
            await js("""(() => {
                for (const el of document.querySelectorAll('mat-checkbox, .mat-mdc-checkbox')) {
                    if (/Ignore outliers/.test(el.textContent)) {
                        const input = el.querySelector('input');
                        if (input && input.checked) input.click();
                    }
                }
            })()""")
            await asyncio.sleep(1)
            await js("""(() => {
                const close = document.querySelector('button[aria-label="Close side pane"]')
                    || [...document.querySelectorAll('button')].find(b => /close/i.test(b.getAttribute('aria-label') || ''));
                if (close) close.click();
            })()""")
            await asyncio.sleep(1)
            await asyncio.sleep(4)
            shot = await call("Page.captureScreenshot", format="png")
            with open(OUT, "wb") as f:
                f.write(base64.b64decode(shot["data"]))
    finally:
        chrome.kill()
        chrome.wait()


asyncio.run(main())
