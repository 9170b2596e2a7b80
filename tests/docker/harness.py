"""What the docker test needs on the host: a Docker daemon (started here, tracked by PID, when one
is installed and none answers), a compose tool (`docker compose` or Debian's `docker-compose`
1.29), a base image and the asyncrl image built from the Dockerfile.

The base image is the Dockerfile's default (python:3.11-slim) when it is present or can be pulled;
when no registry answers it is a minimal Debian bookworm (Python 3.11, pip) made with debootstrap
and `docker import`, trusting the host's CA bundle so that pip inside reaches the package index
the way the host does. Both images are kept by tag, so a second run builds nothing new unless the
sources changed. A torch wheel the host's pip can find offline (its find-links) is put into the
build context's git-ignored wheels/ folder, so the image does not download torch."""

from __future__ import annotations

import os
import platform
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from services.common import procs

ROOT = Path(__file__).resolve().parents[2]
PUBLIC_BASE = "python:3.11-slim"
LOCAL_BASE = "asyncrl-test-base:bookworm"
IMAGE = "asyncrl:docker-test"
INSTALL_HINT = (
    "install docker.io, docker-compose and debootstrap (apt-get install docker.io docker-compose debootstrap)"
)


class Unavailable(Exception):
    """Docker cannot be used here; the message says why and what to install."""


def docker(*args: str, timeout_s: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout_s, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])} failed ({r.returncode}): {(r.stderr or r.stdout)[-3000:]}")
    return r


def daemon_answers() -> bool:
    try:
        return docker("info", timeout_s=30, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def compose_tool() -> list[str]:
    """`docker compose` (the v2 plugin) if present, else `docker-compose` (1.29 on Debian)."""
    if shutil.which("docker"):
        r = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=30)
        if r.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise Unavailable(f"no compose tool (neither `docker compose` nor `docker-compose`): {INSTALL_HINT}")


class Daemon:
    """The Docker daemon for the test: the running one, or `dockerd` started here (root only) and
    stopped by its PID at the end."""

    def __init__(self, log_dir: Path):
        self.log_path = log_dir / "dockerd.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 90) -> Daemon:
        if not shutil.which("docker"):
            raise Unavailable(f"the docker command is not installed: {INSTALL_HINT}")
        if daemon_answers():
            return self
        if not shutil.which("dockerd"):
            raise Unavailable(f"no Docker daemon answers and dockerd is not installed: {INSTALL_HINT}")
        if os.geteuid() != 0:
            raise Unavailable("no Docker daemon answers and only root can start dockerd: start the docker service")
        self.proc = procs.spawn(["dockerd"], log_path=self.log_path)
        deadline = time.monotonic() + timeout_s
        while not daemon_answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = (
                    f"exited with {self.proc.returncode}"
                    if self.proc.poll() is not None
                    else f"no answer in {timeout_s:.0f}s"
                )
                self.stop()
                raise Unavailable(f"dockerd could not start here ({why}): {self.log_tail()}")
            time.sleep(0.2)
        return self

    def log_tail(self, n: int = 1500) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None:
            procs.stop(self.proc, timeout_s=60)
            self.proc = None


def remove_stale_projects(prefix: str) -> None:
    """Containers, then volumes, of compose projects named `<prefix><pid>` whose test process is
    gone (a run killed before its teardown)."""
    label = "com.docker.compose.project"
    for listing, key, remove in (
        (("ps", "-a"), "ID", ("rm", "-f")),
        (("volume", "ls"), "Name", ("volume", "rm", "-f")),
    ):
        out = docker(
            *listing, "--filter", f"label={label}", "--format", f'{{{{.{key}}}}} {{{{.Label "{label}"}}}}'
        ).stdout
        stale = []
        for line in out.splitlines():
            ident, _, project = line.partition(" ")
            pid = project.removeprefix(prefix)
            if project.startswith(prefix) and pid.isdigit() and not procs.pid_alive(int(pid)):
                stale.append(ident)
        if stale:
            docker(*remove, *stale, timeout_s=300)


def image_exists(tag: str) -> bool:
    return docker("image", "inspect", tag, timeout_s=60, check=False).returncode == 0


def host_ca_bundle() -> Path | None:
    """The CA bundle the host's pip trusts (a TLS-inspecting proxy's CA lives there)."""
    for var in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        if os.environ.get(var) and Path(os.environ[var]).is_file():
            return Path(os.environ[var])
    cafile = ssl.get_default_verify_paths().cafile
    return Path(cafile) if cafile and Path(cafile).is_file() else None


def debootstrap_base(tag: str, timeout_s: float = 900) -> None:
    """A minimal Debian bookworm with python3 and pip, imported as `tag` (about a minute)."""
    if os.geteuid() != 0 or not shutil.which("debootstrap"):
        raise Unavailable(
            f"{PUBLIC_BASE} cannot be pulled and no local base can be made (debootstrap, as root): {INSTALL_HINT}"
        )
    with tempfile.TemporaryDirectory(prefix="asyncrl-base-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        cmd = [
            "debootstrap",
            "--variant=minbase",
            "--include=python3,python3-pip,python-is-python3",
            "bookworm",
            str(rootfs),
        ]
        if os.environ.get("ASYNCRL_TEST_DEBIAN_MIRROR"):
            cmd.append(os.environ["ASYNCRL_TEST_DEBIAN_MIRROR"])
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if r.returncode != 0:
            raise RuntimeError(f"debootstrap failed ({r.returncode}): {(r.stderr + r.stdout)[-3000:]}")
        ca = host_ca_bundle()
        if ca is not None:
            shutil.copyfile(ca, rootfs / "etc/ssl/certs/ca-certificates.crt")
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(rootfs / cache, ignore_errors=True)
        changes = ["ENV PIP_BREAK_SYSTEM_PACKAGES=1", "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt",
                   "ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt", 'CMD ["python3"]']  # fmt: skip
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            docker("import", *[a for c in changes for a in ("--change", c)], "-", tag, stdin=tar.stdout, timeout_s=600)
        finally:
            tar.stdout.close()
            tar.wait(timeout=60)


def base_image() -> str:
    """$ASYNCRL_TEST_BASE_IMAGE, else the local base made before, else the public base (pulled
    if need be), else a new local base."""
    if os.environ.get("ASYNCRL_TEST_BASE_IMAGE"):
        return os.environ["ASYNCRL_TEST_BASE_IMAGE"]
    if image_exists(LOCAL_BASE):
        return LOCAL_BASE
    if image_exists(PUBLIC_BASE) or docker("pull", PUBLIC_BASE, timeout_s=600, check=False).returncode == 0:
        return PUBLIC_BASE
    debootstrap_base(LOCAL_BASE)
    return LOCAL_BASE


def local_torch_wheel() -> None:
    """Put the CPU torch 2.13.0 wheel into wheels/ when the host's pip finds it without the
    network; otherwise the Dockerfile installs torch from the pytorch index."""
    wheels = ROOT / "wheels"
    if any(wheels.glob("torch-2.13.0*.whl")):
        return
    wheels.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "torch==2.13.0+cpu", "--no-deps", "--no-index",
                    "--only-binary", ":all:", "--python-version", "3.11",
                    "--platform", f"manylinux_2_28_{platform.machine()}", "-d", str(wheels)],
                   capture_output=True, text=True, timeout=600)  # fmt: skip


def build_image(timeout_s: float = 1500) -> str:
    """The asyncrl image from the Dockerfile, on `base_image()`, tagged IMAGE. Returns the tag."""
    base = base_image()
    local_torch_wheel()
    env = dict(os.environ)
    if docker("buildx", "version", timeout_s=30, check=False).returncode != 0:
        env["DOCKER_BUILDKIT"] = "0"  # a docker CLI without the buildx plugin: the classic builder
    docker("build", "--network", "host", "--build-arg", f"BASE_IMAGE={base}", "-t", IMAGE, str(ROOT),
           timeout_s=timeout_s, env=env)  # fmt: skip
    return IMAGE
