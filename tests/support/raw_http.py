"""Servers on raw sockets for the tests of the gateway's connections to its engines: each answers (or fails
to) at an exact point of an HTTP exchange, as no real server can be made to."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, asyncio.Server], Awaitable[None]]


class Serve(Protocol):
    """`await serve(handler)`: the URL of a server on a free port whose every connection `handler` takes;
    with `tls`, an https one."""

    def __call__(self, handler: Handler, *, tls: ssl.SSLContext | None = None) -> Awaitable[str]: ...


@pytest.fixture(
    name="anyio_backend",
    params=[pytest.param({}, id="asyncio"), pytest.param({"use_uvloop": True}, id="uvloop")],
)
def both_loops(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """Imported by a test module, its tests run on asyncio's loop and on uvloop, which the gateway serves on:
    the two differ in when they call a protocol's callbacks."""
    return "asyncio", request.param


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


async def answers(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _server: asyncio.Server
) -> None:
    """A server that answers every request on a connection."""
    try:
        while True:
            await read_request(reader)
            writer.write(ANSWER)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionResetError):  # the client closed the connection
        writer.close()


class Counted:
    """A handler that counts the connections it has taken (`connections`), then hands each to `handler`."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0

    async def __call__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: asyncio.Server
    ) -> None:
        self.connections += 1
        await self.handler(reader, writer, server)


@asynccontextmanager
async def raw_servers() -> AsyncIterator[Serve]:
    """`await serve(handler)`: the URL of a server on a free port whose every connection `handler` takes."""
    servers: list[asyncio.Server] = []

    async def start(handler: Handler, *, tls: ssl.SSLContext | None = None) -> str:
        async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await handler(reader, writer, server)

        server = await asyncio.start_server(connected, "127.0.0.1", 0, ssl=tls)
        servers.append(server)
        scheme = "https" if tls else "http"
        return f"{scheme}://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    try:
        yield start
    finally:
        for server in servers:
            server.close()


def self_signed(directory: Path) -> tuple[ssl.SSLContext, Path]:
    """A TLS server's context for 127.0.0.1 with a certificate made here, and the file of that certificate
    for clients to trust: as SSL_CERT_FILE, which the default context (the gateway's client's) reads."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "server.crt", directory / "server.key"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return context, cert_file
