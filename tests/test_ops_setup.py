"""Set-up as a newcomer sees it: README command 1 installs only what mounting needs.

tools/setup --plan prints what each form would install without installing
anything, so these checks run the real script.
"""
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEST_ONLY = ("lmcache", "torch", "pytest", "prometheus_client", "fio", "systemd", "tmux", "[test]")


def plan(*args):
    proc = subprocess.run([str(REPO / "tools" / "setup"), "--plan", *args], capture_output=True, text=True,
                          timeout=30, check=True)
    return proc.stdout


def test_scripts_parse():
    for script in ("setup", "mount-default", "run-tests", "install-lmcache"):
        subprocess.run(["bash", "-n", str(REPO / "tools" / script)], check=True)
    subprocess.run(["bash", "-n", str(REPO / ".ci" / "run")], check=True)


def test_mount_setup_installs_no_test_dependencies():
    mount = plan()
    assert "apt: fuse3 libfuse3-dev" in mount and "pip: -e .\n" in mount
    assert not [word for word in TEST_ONLY if word in mount], mount


def test_test_setup_adds_the_test_dependencies():
    full = plan("--test")
    for word in ("fio", "attr", "systemd", "tmux", "-e .[test]", "torch==", "install-lmcache"):
        assert word in full, (word, full)


def test_readme_commands_use_the_right_forms():
    mount_default = (REPO / "tools" / "mount-default").read_text()
    run_tests = (REPO / "tools" / "run-tests").read_text()
    assert "\ntools/setup\n" in mount_default
    assert "\ntools/setup --test\n" in run_tests
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == "exec tools/run-tests </dev/null"            # CI runs exactly README command 2
    readme = (REPO / "README.md").read_text()
    assert "tools/mount-default /mnt/kvfs" in readme and "tools/run-tests " in readme
    extras = (REPO / "setup.cfg").read_text()
    assert "prometheus_client" in extras.split("test =", 1)[1].split("\n\n", 1)[0]


def test_setup_rejects_an_unknown_argument_in_one_line():
    proc = subprocess.run([str(REPO / "tools" / "setup"), "--bogus"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr == "tools/setup: unknown argument '--bogus' (see tools/setup --help)\n"
