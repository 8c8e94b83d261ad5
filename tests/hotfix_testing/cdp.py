"""Headless Chromium driven over the Chrome DevTools protocol with the standard library only (no browser download,
no npm): launch, open a page, evaluate JavaScript, take screenshots."""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium_binary():
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Page:
    """One page of a fresh headless Chromium (own --user-data-dir), closed with ``close()``."""

    def __init__(self, width=1600, height=1000):
        self.profile = tempfile.mkdtemp(prefix="chromium-profile-")
        self.process = subprocess.Popen(
            [chromium_binary(), *FLAGS, f"--user-data-dir={self.profile}", "--remote-debugging-port=0",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        port = None
        deadline = time.monotonic() + 60
        while port is None and time.monotonic() < deadline:
            line = self.process.stderr.readline()
            found = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
            port = found and int(found.group(1))
        if port is None:
            self.close()
            raise RuntimeError("Chromium did not start")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list") as response:
            page = next(t for t in json.load(response) if t["type"] == "page")
        self.socket = _websocket(page["webSocketDebuggerUrl"])
        self.ids = itertools.count(1)
        self.send("Runtime.enable")
        self.send("Page.enable")

    def send(self, method, **params):
        message_id = next(self.ids)
        _send_frame(self.socket, json.dumps({"id": message_id, "method": method, "params": params}))
        while True:
            reply = json.loads(_read_message(self.socket))
            if reply.get("id") == message_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def evaluate(self, expression, timeout_s=120):
        """Value of a JavaScript expression (awaited, returned by value); raises on a JavaScript exception."""
        result = self.send("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True,
                           timeout=timeout_s * 1000)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise RuntimeError(details.get("exception", {}).get("description") or details.get("text"))
        return result["result"].get("value")

    def navigate(self, url):
        self.send("Page.navigate", url=url)

    def wait_for(self, expression, timeout_s=120):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.evaluate(expression):
                    return
            except RuntimeError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"waited {timeout_s} s for {expression}")

    def screenshot(self, path):
        data = self.send("Page.captureScreenshot", format="png")["data"]
        with open(path, "wb") as out:
            out.write(base64.b64decode(data))

    def click(self, x, y, button="left"):
        """Moves the mouse to (x, y) and clicks there, as a user would: the canvas reads the pointer's position and
        the pressed buttons."""
        self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        buttons = {"left": 1, "right": 2, "middle": 4}[button]
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button=button, buttons=buttons, clickCount=1)

    def close(self):
        self.process.terminate()
        self.process.wait(timeout=30)
        shutil.rmtree(self.profile, ignore_errors=True)


def _websocket(url):
    host, port, path = re.match(r"ws://([^:/]+):(\d+)(/.*)", url).groups()
    sock = socket.create_connection((host, int(port)))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall((f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    response = b""
    while b"\r\n\r\n" not in response:
        response += sock.recv(1)
    if b" 101 " not in response.split(b"\r\n")[0]:
        raise RuntimeError(f"websocket handshake failed: {response[:200]!r}")
    return sock


def _send_frame(sock, text):
    payload = text.encode()
    header = bytes([0x81])
    length = len(payload)
    if length < 126:
        header += bytes([0x80 | length])
    elif length < 1 << 16:
        header += bytes([0x80 | 126]) + struct.pack(">H", length)
    else:
        header += bytes([0x80 | 127]) + struct.pack(">Q", length)
    mask = os.urandom(4)
    sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))


def _read_exact(sock, size):
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("DevTools connection closed")
        data += chunk
    return bytes(data)


def _read_message(sock):
    message = bytearray()
    while True:
        first, second = _read_exact(sock, 2)
        length = second & 0x7F
        if length == 126:
            length = struct.unpack(">H", _read_exact(sock, 2))[0]
        elif length == 127:
            length = struct.unpack(">Q", _read_exact(sock, 8))[0]
        payload = _read_exact(sock, length)
        if first & 0x0F in (0x1, 0x0):
            message += payload
            if first & 0x80:
                return message.decode()
