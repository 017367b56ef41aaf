"""The plugin against each pinned SGLang, each in its own interpreter.

Each version lives in ``.sglang/<version>`` (``scripts/install_sglang_cpu.sh``
installs them); a version that is missing is skipped. SGLang's package import
pulls in ``triton`` and ``torchvision.io``; when they are not installed, the
empty stand-ins of :func:`sglang_hooks.testing.write_import_stand_ins` take their
place.

* :func:`test_inside_sglang` runs ``tests/test_sglang_inside.py`` in a subprocess
  per version (SGLang's loader runs once per process);
* the other tests start one interpreter each to watch ``load_plugins()`` decide
  what to register: in a scheduler process (full hooks; a follower without
  ``SPECCTL_*`` variables) or another SGLang process (nothing), with a bad
  variable, an untested SGLang (with and without the opt-in), a missing hook
  target.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

from sglang_hooks.contract import HOOK_TARGETS, OFF_SWITCH_TARGETS, POLICY_CLASS
from sglang_hooks.testing import write_import_stand_ins

REPO = Path(__file__).resolve().parents[1]
VERSIONS = ("0.5.15.post1", "0.5.23")
NEWEST = "0.5.23"
OLDEST = "0.5.15.post1"
UNUSED = "ipc:///tmp/specctl-never-connected.sock"  # registering does not connect



def sglang_root(version: str) -> Path:
    return REPO / ".sglang" / version


def require(version: str) -> Path:
    root = sglang_root(version)
    if not (root / "sglang").is_dir():
        pytest.skip(f"SGLang {version} is not installed in {root} "
                    "(run scripts/install_sglang_cpu.sh)")
    return root


@pytest.fixture(scope="session")
def extra_path(tmp_path_factory) -> str:
    """Shims for what is not installed, and the entry point if the project is not."""
    base = tmp_path_factory.mktemp("sglang-extra")
    write_import_stand_ins(base)
    names = {ep.name for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")}
    if "specctl" not in names:
        pyproject = (REPO / "pyproject.toml").read_text()
        section = pyproject.split('[project.entry-points."sglang.srt.plugins"]')[1]
        entry = re.search(r'^specctl\s*=\s*"([^"]+)"', section, re.M).group(1)
        info = base / "specctl_entry_point-0.0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: specctl-entry-point\n"
                                       "Version: 0.0.0\n")
        (info / "entry_points.txt").write_text(f"[sglang.srt.plugins]\nspecctl = {entry}\n")
    return str(base)


def environment(sglang_path: Path, extra_path: str, env: dict[str, str]) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SPECCTL_", "SGLANG_"))}
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    clean["PYTHONPATH"] = os.pathsep.join([str(REPO), str(sglang_path), extra_path, *inherited])
    return {**clean, **env}


def run(sglang_path: Path, extra_path: str, args: list[str], env: dict[str, str],
        timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=environment(sglang_path, extra_path, env),
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("version", VERSIONS)
def test_inside_sglang(version, extra_path, tmp_path):
    root = require(version)
    report = tmp_path / "report.xml"
    result = run(root, extra_path, [
        "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "t"),
        f"--junitxml={report}", str(REPO / "tests" / "test_sglang_inside.py"),
    ], {"SPECCTL_SGLANG_INSIDE": version, "SPECCTL_CONTROLLER": UNUSED})
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    suite = ElementTree.parse(report).getroot().find("testsuite")
    counts = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
    assert counts["tests"] >= 10 and counts["failures"] == counts["errors"] == 0, counts
    assert counts["skipped"] == 0, counts


# What one SGLang process does with the plugin: load it, report what got registered.
PROBE = """
import json, logging
records = []
class Keep(logging.Handler):
    def emit(self, record):
        if record.name.startswith("sglang_hooks"):
            records.append((record.levelname, record.getMessage()))
logging.getLogger().addHandler(Keep())
logging.getLogger().setLevel(logging.INFO)
logging.getLogger("sglang.srt.plugins.hook_registry").setLevel(logging.CRITICAL)
import os, sys
from sglang.srt.speculative import adaptive_spec_params as asp
original = {"cls": asp.AdaptiveSpeculativeParams}
from sglang_hooks import testing
testing.warmup_import_stand_ins()  # SGLang's warm-up module needs transformers otherwise
if sys.argv[1] == "scheduler":
    testing.load_plugins_as_scheduler()
elif sys.argv[1].startswith("http"):  # the HTTP server's process: "http_<entry>"
    testing.load_plugins_as_http(sys.argv[1][len("http_"):] or "engine")
else:  # the detokenizer, DP controller
    import sglang.srt.plugins
    sglang.srt.plugins.load_plugins()
from sglang.srt.plugins.hook_registry import HookRegistry
warmups = sys.modules.get("sglang.srt.entrypoints.warmup")
report = {
    "hooks": sorted(HookRegistry._hooks),
    "replaced": asp.AdaptiveSpeculativeParams is not original["cls"],
    "warmups": sorted(warmups._warmup_registry) if warmups else None,
}
if sys.argv[1].startswith("http"):
    import asyncio
    registered = warmups._warmup_registry["specctl"]
    # Engine.__init__ and Engine._launch_subprocesses both load plugins: again, past
    # SGLang's own once-only flag
    import sglang.srt.plugins
    sglang.srt.plugins._plugins_loaded = False
    testing.load_plugins_as_http()
    report["same_function"] = warmups._warmup_registry["specctl"] is registered
    tm = testing.TokenizerManagerStandIn(max_running_requests=48)
    # SGLang's own runner, as the HTTP server's lifespan calls it with --warmups specctl
    asyncio.run(warmups.execute_warmups("null", ["specctl"], tm))
    report["batches"] = [len(r.rid) for r in tm.requests]
    report["rids"] = sorted({rid.rsplit("-", 2)[0] for r in tm.requests for rid in r.rid})
report["logs"] = records
print(json.dumps(report))
"""


def overlay(tmp_path: Path, version: str, *, metadata_version: str | None = None,
            edit: tuple[str, str, str] | None = None) -> Path:
    """A site directory that is the pinned SGLang, except a changed version or file.

    Symlinks all but the changed parts, so SGLang imports from here unchanged.
    """
    root = sglang_root(version)
    site = tmp_path / "site"
    site.mkdir(parents=True)

    def mirror(src: Path, dst: Path, changed: Path | None) -> None:
        dst.mkdir()
        for child in src.iterdir():
            target = dst / child.name
            if changed is not None and child == changed:
                target.write_text(child.read_text().replace(edit[1], edit[2]))
            elif changed is not None and child in changed.parents:
                mirror(child, target, changed)
            else:
                target.symlink_to(child)

    changed = root / edit[0] if edit else None
    mirror(root / "sglang", site / "sglang", changed)
    for info in root.glob("sglang-*.dist-info"):
        if metadata_version is None:
            (site / info.name).symlink_to(info)
        else:
            copy = site / f"sglang-{metadata_version}.dist-info"
            shutil.copytree(info, copy)
            text = (copy / "METADATA").read_text()
            (copy / "METADATA").write_text(text.replace(f"Version: {version}",
                                                        f"Version: {metadata_version}"))
    return site


@pytest.fixture(scope="session")
def probes(extra_path, tmp_path_factory) -> dict[str, dict]:
    """Every scenario's report, from interpreters started all at once (they are slow)."""
    root = require(NEWEST)
    tmp = tmp_path_factory.mktemp("probes")
    untested = overlay(tmp / "version", NEWEST, metadata_version="0.5.99")
    scenarios = {
        "active": (root, {"SPECCTL_CONTROLLER": UNUSED}, "scheduler"),
        "sglang_off_path": (root, {"SPECCTL_CONTROLLER": UNUSED, "SPECCTL_OFF_PATH": "sglang"},
                            "scheduler"),
        "not_a_scheduler": (root, {"SPECCTL_CONTROLLER": UNUSED}, "main"),
        "http": (root, {"SPECCTL_CONTROLLER": UNUSED}, "http"),
        "http_no_variables": (root, {}, "http"),
        "http_oldest": (require(OLDEST), {}, "http"),
        # the command-line entries, which load the plugins before the engine does
        "http_launch_server": (root, {"SPECCTL_CONTROLLER": UNUSED}, "http_launch_server"),
        "http_launch_server_oldest": (require(OLDEST), {}, "http_launch_server"),
        "http_serve": (root, {}, "http_serve"),
        "http_serve_oldest": (require(OLDEST), {}, "http_serve"),
        "no_variables": (root, {"SPECCTL_TIMEOUT_MS": "50"}, "scheduler"),
        "no_variables_not_a_scheduler": (root, {}, "main"),
        "bad_variable": (root, {"SPECCTL_CONTROLLER": UNUSED, "SPECCTL_TIMEOUT_MS": "soon"},
                         "scheduler"),
        "unsupported_version": (untested, {"SPECCTL_CONTROLLER": UNUSED}, "scheduler"),
        "untested_allowed": (untested, {"SPECCTL_CONTROLLER": UNUSED,
                                        "SPECCTL_ALLOW_UNTESTED_SGLANG": "1"}, "scheduler"),
        "missing_target": (overlay(tmp / "target", NEWEST, edit=(
            "sglang/srt/managers/scheduler.py", "    def run_batch(", "    def run_batch_v2(")),
            {"SPECCTL_CONTROLLER": UNUSED, "SPECCTL_ALLOW_UNTESTED_SGLANG": "1"}, "scheduler"),
    }
    started = {
        name: subprocess.Popen([sys.executable, "-c", PROBE, process], cwd=REPO, text=True,
                               env=environment(path, extra_path, env),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for name, (path, env, process) in scenarios.items()
    }
    reports = {}
    for name, process in started.items():
        out, err = process.communicate(timeout=240)
        assert process.returncode == 0, f"{name}: {err[-3000:]}"
        reports[name] = json.loads(out.strip().splitlines()[-1])
    return reports


EVERY_HOOK = {POLICY_CLASS, *(t.target for t in HOOK_TARGETS),
              *(t.target for t in OFF_SWITCH_TARGETS)}


@pytest.mark.parametrize("scenario", ["active", "sglang_off_path"])
def test_active_plugin_registers_everything(probes, scenario):
    """The off switch's hooks too: with SPECCTL_OFF_PATH=sglang this rank still takes part
    in the start-up agreement of the TP group on the off path (sglang_hooks.offswitch)."""
    report = probes[scenario]
    assert report["replaced"] and set(report["hooks"]) == EVERY_HOOK, report
    assert any("hooks registered" in message for _, message in report["logs"])


@pytest.mark.parametrize("scenario", ["not_a_scheduler", "no_variables_not_a_scheduler"])
def test_other_sglang_processes_register_nothing_and_say_nothing(probes, scenario):
    """The detokenizer and DP controller run no hooks and register no warm-up."""
    assert probes[scenario] == {"hooks": [], "replaced": False, "warmups": None, "logs": []}


@pytest.mark.parametrize("scenario", ["http", "http_no_variables", "http_oldest",
                                      "http_launch_server", "http_launch_server_oldest",
                                      "http_serve", "http_serve_oldest"])
def test_the_http_process_registers_the_warmup_once_and_nothing_else(probes, scenario):
    """With or without the variables (``--warmups specctl`` asks for it), in both pinned
    versions; SGLang's own ``execute_warmups`` runs it through the tokenizer manager."""
    report = probes[scenario]
    assert report["hooks"] == [] and not report["replaced"], report
    assert "specctl" in report["warmups"], report
    assert report["same_function"], report
    assert report["batches"] == [1, 2, 4, 8, 16, 32, 48]
    [tag] = report["rids"]  # one run: every request id is "<prefix><pid>-<batch>-<i>"
    assert tag.startswith("specctl-warmup-"), report
    assert [m for _, m in report["logs"]].count(
        "specctl: warm-up 'specctl' registered (--warmups specctl runs it at start-up)") == 1


def test_scheduler_processes_register_no_warmup(probes):
    assert probes["active"]["warmups"] is None and probes["no_variables"]["warmups"] is None


def test_without_variables_a_scheduler_registers_a_follower(probes):
    """Another node's ranks must strip (and follow) the source's markers."""
    report = probes["no_variables"]
    assert report["replaced"] and set(report["hooks"]) == EVERY_HOOK, report
    [(level, message)] = report["logs"]
    assert level == "INFO" and "follower hooks registered" in message


def test_bad_configuration_patches_nothing_and_says_which_variable(probes):
    report = probes["bad_variable"]
    assert report["hooks"] == [] and not report["replaced"]
    assert report["logs"] == [["WARNING", "specctl: not enabled, bad configuration: "
                                          "SPECCTL_TIMEOUT_MS='soon': not a number"]]


def test_untested_sglang_version_patches_nothing_without_the_opt_in(probes):
    report = probes["unsupported_version"]
    assert report["hooks"] == [] and not report["replaced"]
    [(level, message)] = report["logs"]
    assert level == "WARNING" and "SGLang 0.5.99 is not a tested version" in message
    assert "SPECCTL_ALLOW_UNTESTED_SGLANG=1" in message


def test_untested_sglang_version_that_passes_a_contract_runs_with_the_opt_in(probes):
    report = probes["untested_allowed"]
    assert report["replaced"] and set(report["hooks"]) == EVERY_HOOK, report
    levels = dict((message.split(";")[0], level) for level, message in report["logs"])
    assert levels["specctl: SGLang 0.5.99 is untested"] == "WARNING"


def test_missing_hook_target_patches_nothing(probes):
    """Even with the opt-in: the source must pass a tested version's contract."""
    report = probes["missing_target"]
    assert report["hooks"] == [] and not report["replaced"]
    [(level, message)] = report["logs"]
    assert level == "WARNING" and "Scheduler.run_batch: method not found" in message
