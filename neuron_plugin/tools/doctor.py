"""`neuron-plugin doctor`: what in this environment stops the plugin from serving on
Neuron, and how to fix it.

Checks: Neuron devices and visible cores, the installed vLLM (release and build, and
whether a test run proves that pair: `core.vllm_builds`), NxD Inference /
torch-neuronx / neuronx-cc against the supported matrix (`SUPPORTED`, mirrored in
docs/reference/neuron-plugin.md), the version pins those packages declare (NxDI pins transformers
and torch-neuronx pins torch), the platform entry point, compile-cache reachability and
disk space. With a backend runner (`VLLM_NEURON_BACKEND_PYTHON` or `--backend-python`) it
also starts the runner in that interpreter and shakes hands (the backend must import
there), and checks the NxD packages in the runner's environment, where they live. Whether
NxD Inference imports (there, or here without a runner) says where the nxd backend can
run: on the devices, or in NxDI's CPU mode only.
Each check has a status (ok, info, warn, fail) and, unless ok, a fix; the
exit code is 1 when any check fails. `--json` prints {"ok": ..., "checks": [...]}.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from neuron_plugin import BACKEND_ENV, BACKEND_PYTHON_ENV, BACKENDS, neuron_devices
from neuron_plugin.core import nxdi_releases
from neuron_plugin.core.instances import (
    INSTANCE_TYPES,
    VISIBLE_CORES_ENV,
    detect_instance_type,
    lnc,
    package_version,
    parse_core_list,
    visible_cores,
)
from neuron_plugin.core.settings import NeuronConfigError
from neuron_plugin.core.vllm_builds import SUPPORTED_RELEASES, VllmBuild, installed_vllm
from neuron_plugin.models.third_party import ENTRY_POINT_GROUP

GIB = 1 << 30
DISK_WARN_BYTES = 20 * GIB
DISK_FAIL_BYTES = 1 * GIB
NXDI = "neuronx-distributed-inference"


@dataclass(frozen=True)
class Supported:
    distribution: str
    specifier: str
    why: str


SUPPORTED = (
    Supported(
        NXDI,
        ">=0.7,<0.11",
        "the NxD seam follows NxDI 0.7-0.10 (Neuron SDK 2.27-2.31), checked on real NxDI "
        "0.8 and 0.9; inf2/trn1 need < 0.9 (SDK 2.28: NxDI 0.8)",
    ),
    Supported("torch-neuronx", ">=2.8", "runs NxDI's traced graphs"),
    Supported("neuronx-cc", ">=2", "compiles NxDI's graphs"),
)
PINNED_BY_NEURON = (NXDI, "neuronx-distributed", "torch-neuronx", "neuronx-cc")


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | info | warn | fail
    detail: str
    fix: str = ""


def installed(names: Iterable[str]) -> dict[str, str | None]:
    return {name: package_version(name) for name in names}


def check_devices(devices: Sequence[str]) -> Check:
    if devices:
        return Check("neuron devices", "ok", f"{len(devices)}: {', '.join(devices)}")
    return Check(
        "neuron devices",
        "warn",
        "no Neuron devices (/dev/neuron*): only the CPU reference backend can run "
        "here (VLLM_NEURON_BACKEND=reference)",
        "run on an inf2/trn1/trn2 instance with the Neuron driver (aws-neuronx-dkms) loaded",
    )


def check_cores(environ: Mapping[str, str], devices: Sequence[str], instance: str | None) -> Check:
    try:
        count, source = visible_cores(
            environ, devices, INSTANCE_TYPES[instance] if instance else None
        )
    except ValueError as exc:
        return Check("visible cores", "fail", str(exc), f"fix or unset {VISIBLE_CORES_ENV}")
    if count is None and not devices:
        return Check("visible cores", "warn", source)
    if count is None:
        return Check(
            "visible cores",
            "warn",
            source,
            f"set {VISIBLE_CORES_ENV} to the cores to use (neuron-ls lists them)",
        )
    total = (
        len(devices) * INSTANCE_TYPES[instance].chip.logical_cores(lnc(environ))
        if devices and instance
        else None
    )
    value = environ.get(VISIBLE_CORES_ENV)
    if value and total is not None and max(parse_core_list(value)) >= total:
        return Check(
            "visible cores",
            "fail",
            f"{VISIBLE_CORES_ENV}={value} names cores beyond the {total} of this host",
            f"use core ids 0-{total - 1}",
        )
    return Check(
        "visible cores", "ok", f"{count} ({source}); --tensor-parallel-size may be at most {count}"
    )


def check_instance(instance: str | None) -> Check:
    if instance:
        t = INSTANCE_TYPES[instance]
        return Check(
            "instance type",
            "ok",
            f"{instance}: {t.chips} x {t.chip.name}, {t.cores(lnc())} NeuronCores, "
            f"{t.memory_per_core(lnc()) / GIB:.0f} GiB HBM per core",
        )
    return Check(
        "instance type", "info", "not an EC2 Neuron instance type (DMI product name unknown)"
    )


def check_vllm(vllm: VllmBuild | None) -> Check:
    """The installed vLLM: its version and build, and whether a test run proves it."""
    fix = f"pip install 'vllm{SUPPORTED_RELEASES}' (docs/serving/inf2.md, step 3)"
    if vllm is None:
        return Check("vllm", "fail", "vLLM is not installed", fix)
    if not vllm.supported():
        return Check(
            "vllm",
            "fail",
            f"{vllm.describe()}: the plugin implements the contracts of vLLM "
            f"{SUPPORTED_RELEASES} only",
            fix,
        )
    tested = vllm.tested_by()
    if tested is None:
        return Check(
            "vllm",
            "warn",
            f"{vllm.describe()}: supported release, but this build is untested",
            f"{fix}; or run `neuron-plugin validate` on this host and report the result",
        )
    return Check("vllm", "ok", f"{vllm.describe()}: tested ({tested})")


def check_versions(
    versions: Mapping[str, str | None], has_devices: bool, chip_target: str | None
) -> list[Check]:
    """Each NxD package against its specifier; required only where Neuron devices
    exist."""
    checks = []
    for item in SUPPORTED:
        found = versions.get(item.distribution)
        name = f"{item.distribution} version"
        if found is None:
            checks.append(
                Check(
                    name,
                    "fail" if has_devices else "info",
                    f"not installed ({item.why})",
                    "see docs/serving/inf2.md" if has_devices else "",
                )
            )
            continue
        base = Version(found).base_version
        if Version(base) not in SpecifierSet(item.specifier):
            checks.append(
                Check(
                    name,
                    "fail",
                    f"{found} is outside {item.specifier} ({item.why})",
                    f"install {item.distribution}{item.specifier}",
                )
            )
            continue
        if item.distribution == NXDI:
            checks.append(check_nxdi_release(found, chip_target))
            continue
        checks.append(Check(name, "ok", found))
    return checks


def check_nxdi_release(found: str, chip_target: str | None) -> Check:
    """The installed NxDI against the instance family's release and the releases the
    plugin was checked on (core/nxdi_releases.py)."""
    name = f"{NXDI} version"
    wanted = nxdi_releases.for_family(chip_target)
    family = f"{chip_target} runs {wanted.describe()}" if chip_target else ""
    if not nxdi_releases.supports(found, chip_target):
        return Check(
            name,
            "fail",
            f"{found} does not support {chip_target}: NxDI 0.9 (Neuron SDK 2.29) and later "
            f"support Trn2 and newer only (SDK 2.29 release notes)",
            f"install {wanted.describe()} on {chip_target}",
        )
    checked = nxdi_releases.checked(found)
    if checked is None:
        names = ", ".join(r.describe() for r in nxdi_releases.CHECKED)
        return Check(
            name,
            "warn",
            f"{found}: not a release the plugin was checked on with real NxDI ({names})",
            f"install {wanted.describe()}, or run `neuron-plugin validate` on this host",
        )
    return Check(
        name, "ok", "; ".join(filter(None, [f"{found}: {checked.describe()}, checked", family]))
    )


def unmet_requirements(
    distribution: str, versions: Mapping[str, str | None], requires: Sequence[str]
) -> list[str]:
    """`distribution`'s declared requirements that the installed versions break."""
    unmet = []
    for line in requires:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        found = versions.get(requirement.name)
        if found is not None and not requirement.specifier.contains(found, prereleases=True):
            unmet.append(
                f"{distribution} requires {requirement.name}"
                f"{requirement.specifier} but {found} is installed"
            )
    return unmet


# What the nxd backend imports first (backends/nxd/nxdi.py); its version from metadata.
NXDI_IMPORT = (
    "import importlib.metadata, neuronx_distributed_inference.models.model_base; "
    "print(importlib.metadata.version('neuronx-distributed-inference'))"
)


def check_nxdi_import(python: str, devices: Sequence[str], environ: Mapping[str, str]) -> Check:
    """Whether NxD Inference imports under `python` (the runner's interpreter or this
    one), and so where the nxd backend can run: on the Neuron devices, or only in NxDI's
    own CPU mode on a host without one."""
    try:
        done = subprocess.run(
            [python, "-c", NXDI_IMPORT],
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(environ),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check(
            "nxdi import",
            "fail",
            f"{python}: {exc}",
            "fix VLLM_NEURON_BACKEND_PYTHON (or --backend-python)",
        )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return Check(
            "nxdi import",
            "fail" if devices else "info",
            f"NxD Inference does not import under {python}: {last}",
            "install the Neuron SDK's NxDI in the backend runner's environment "
            "(docs/serving/inf2.md)",
        )
    version = done.stdout.strip().splitlines()[-1]
    if devices:
        return Check(
            "nxdi import",
            "ok",
            f"NxDI {version} imports under {python}; the nxd backend runs on the Neuron devices",
        )
    return Check(
        "nxdi import",
        "info",
        f"NxDI {version} imports under {python} but there is no Neuron device: the "
        f"nxd backend runs only in NxDI's CPU mode, for accuracy checks",
        "VLLM_NEURON_BACKEND=nxd with --additional-config "
        '\'{"override_neuron_config": {"on_cpu": true}}\'',
    )


REGISTERED = (
    "import importlib.metadata as m, json; "
    "from neuron_plugin.models.third_party import ENTRY_POINT_GROUP, check_registered; "
    "found = list(m.entry_points(group=ENTRY_POINT_GROUP)); "
    "print(json.dumps({'classes': {ep.name: ep.value for ep in found}, "
    "'problems': check_registered(found)}))"
)


def check_model_classes(python: str, environ: Mapping[str, str]) -> Check:
    """The model classes registered under the entry-point group in the backend's
    environment (`python`): each names its architecture and class, and must import as
    an NxDI application class; none registered: the architecture table's classes."""
    name = "model classes"
    try:
        done = subprocess.run(
            [python, "-c", REGISTERED],
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(environ),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check(name, "fail", f"{python}: {exc}", "fix VLLM_NEURON_BACKEND_PYTHON")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return Check(
            name,
            "fail",
            f"the plugin does not import under {python}: {last}",
            f"{python} -m pip install 'vllm-neuron-plugin[backend]'",
        )
    found = json.loads(done.stdout.strip().splitlines()[-1])
    if not found["classes"]:
        return Check(
            name,
            "info",
            f"none registered under {ENTRY_POINT_GROUP} in {python}: "
            f"the architecture table's classes serve "
            f"(`neuron-plugin models`)",
        )
    named = ", ".join(f"{arch} -> {value}" for arch, value in sorted(found["classes"].items()))
    wrong = [problem for problem in found["problems"].values() if problem]
    if wrong:
        return Check(
            name,
            "fail",
            "; ".join(wrong),
            f"fix or uninstall the package registering it under {ENTRY_POINT_GROUP}",
        )
    return Check(name, "ok", f"registered under {ENTRY_POINT_GROUP}: {named}")


def check_requirements(versions: Mapping[str, str | None]) -> list[Check]:
    checks = []
    for dist in PINNED_BY_NEURON:
        if versions.get(dist) is None:
            continue
        requires = importlib.metadata.requires(dist) or []
        names = {Requirement(r).name for r in requires if _parses(r)}
        unmet = unmet_requirements(dist, {**installed(names), **versions}, requires)
        checks.append(
            Check(
                f"{dist} pins",
                "fail" if unmet else "ok",
                "; ".join(unmet) or "declared requirements met",
                "install the versions the Neuron SDK release pins in its own "
                "environment (vLLM 0.32/0.33 need torch 2.13/2.14 and transformers 5)"
                if unmet
                else "",
            )
        )
    return checks


def _parses(line: str) -> bool:
    try:
        Requirement(line)
    except InvalidRequirement:
        return False
    return True


def check_platform_entry_point() -> Check:
    names = {ep.name for ep in importlib.metadata.entry_points(group="vllm.platform_plugins")}
    if "neuron" in names:
        return Check("vllm platform plugin", "ok", "entry point vllm.platform_plugins:neuron")
    return Check(
        "vllm platform plugin",
        "fail",
        "the neuron platform entry point is not registered",
        "pip install -e . (this repo)",
    )


def check_cache(environ: Mapping[str, str]) -> tuple[Check, Path | None]:
    """Reachability of the compile cache, and the local folder its entries land in."""
    from compile_cache.errors import CacheError
    from compile_cache.stores import open_store

    try:
        store = open_store(environ=environ)
        store.list_keys()
    except (CacheError, OSError) as exc:
        return Check(
            "compile cache",
            "fail",
            str(exc),
            "fix VLLM_NEURON_CACHE_URL or the store's credentials",
        ), None
    root = store.disk
    existing = next((p for p in (root, *root.parents) if p.exists()), None)
    if existing is None or not os.access(existing, os.W_OK):
        return Check(
            "compile cache",
            "fail",
            f"{store.url}: {root} is not writable",
            "set VLLM_NEURON_CACHE_URL to a writable directory",
        ), root
    return Check("compile cache", "ok", store.url), root


def check_disk(label: str, path: Path) -> Check:
    existing = next(p for p in (path, *path.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    detail = f"{free / GIB:.1f} GiB free at {existing}"
    if free < DISK_FAIL_BYTES:
        return Check(f"disk space ({label})", "fail", detail, f"free space under {existing}")
    if free < DISK_WARN_BYTES:
        return Check(
            f"disk space ({label})",
            "warn",
            detail,
            "compiled artifacts (with save_sharded_checkpoint, plus a copy of the "
            "weights) need tens of GiB for 8B-class models; free space or move "
            "the cache",
        )
    return Check(f"disk space ({label})", "ok", detail)


def check_runner(python: str, backend: str) -> tuple[Check, dict[str, str | None]]:
    """Start the backend runner under `python` and shake hands: (check, its versions)."""
    from neuron_plugin.backends.runner.client import RunnerError, probe

    try:
        handshake = probe(python, backend)
    except (RunnerError, NeuronConfigError) as exc:
        return Check(
            "backend runner",
            "fail",
            str(exc).splitlines()[0][:400],
            f"{python} -m pip install 'vllm-neuron-plugin[backend]' (and the Neuron "
            f"SDK packages for nxd), or fix VLLM_NEURON_BACKEND_PYTHON",
        ), {}
    v = handshake["versions"]
    return Check(
        "backend runner",
        "ok",
        f"{backend} backend in {python}: Python {v['python']}, torch {v['torch']}, "
        f"transformers {v['transformers']}, NxDI {v[NXDI]}",
    ), v


def collect(
    environ: Mapping[str, str] = os.environ,
    backend_python: str | None = None,
    backend: str | None = None,
) -> list[Check]:
    """Every check for this host; with a runner interpreter, the NxD packages are
    those of the runner's environment."""
    devices = neuron_devices()
    instance = detect_instance_type()
    target = INSTANCE_TYPES[instance].chip.target if instance else None
    versions = installed([s.distribution for s in SUPPORTED] + ["torch", "transformers"])
    cache, root = check_cache(environ)
    runner_checks: list[Check] = []
    backend_python = backend_python or environ.get(BACKEND_PYTHON_ENV)
    if backend_python:
        chosen = backend or environ.get(BACKEND_ENV) or ("nxd" if devices else "reference")
        runner, runner_versions = check_runner(backend_python, chosen)
        runner_checks.append(runner)
        versions = {
            **versions,
            **{s.distribution: runner_versions.get(s.distribution) for s in SUPPORTED},
        }
    nxdi = check_nxdi_import(backend_python or sys.executable, devices, environ)
    checks = [
        check_devices(devices),
        check_instance(instance),
        check_cores(environ, devices, instance),
        *runner_checks,
        nxdi,
        check_vllm(installed_vllm(package_version)),
        *check_versions(versions, bool(devices), target),
        *([] if backend_python else check_requirements(versions)),
        check_platform_entry_point(),
        check_model_classes(backend_python or sys.executable, environ),
        cache,
    ]
    if root is not None:
        checks.append(check_disk("compile cache", root))
    checks.append(check_disk("neuronx-cc work dir", Path("/tmp")))
    return checks


def render(checks: Sequence[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"[{c.status:>4}] {c.name:<{width}}  {c.detail}")
        if c.fix:
            lines.append(f"       {'':<{width}}  fix: {c.fix}")
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor", help="check devices, packages, compile cache and disk for serving on Neuron"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='print {"ok": bool, "checks": [...]} (see docs/reference/neuron-plugin.md)',
    )
    parser.add_argument(
        "--backend-python",
        metavar="PYTHON",
        help=f"the backend runner's interpreter (default: "
        f"${BACKEND_PYTHON_ENV}); starts it and checks the handshake",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        help=f"the backend the runner must host (default: ${BACKEND_ENV}, "
        f"else nxd on a Neuron host, reference elsewhere)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    checks = collect(backend_python=args.backend_python, backend=args.backend)
    ok = all(c.status != "fail" for c in checks)
    if args.json:
        print(json.dumps({"ok": ok, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        print(render(checks))
    return 0 if ok else 1
