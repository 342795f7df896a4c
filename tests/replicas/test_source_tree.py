"""Installed distributions named like megaserve's folders are imported from where they are installed,
also where the checkout's root is first on sys.path: in this test process (pytest puts it there), in
a process started in the checkout as Ray starts its workers (the driver's working directory first on
sys.path), and in an SGLang replica's process before it imports SGLang (and so transformers)."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import subprocess
import sys
import textwrap
from pathlib import Path

from megaserve.replicas import source_tree
from megaserve.replicas.source_tree import PACKAGE_FOLDERS, SOURCE_ROOT, import_installed_namesakes
from tests.conftest import REPO_ROOT, SHADOWED_DISTRIBUTIONS

INSTALLED = set(importlib.metadata.packages_distributions())
# Hugging Face's `kernels`, which transformers 5.25 and later depends on and imports
KERNELS_INSTALLED = "kernels" in INSTALLED


def _in_checkout(code: str, cwd: Path = REPO_ROOT) -> dict:
    """Run `code` in `python -c` from `cwd` (so that cwd is first on sys.path, as in a Ray worker of a
    driver started there); it prints one JSON object, returned."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_an_editable_install_s_source_root_is_the_checkout():
    assert SOURCE_ROOT == REPO_ROOT
    assert all((REPO_ROOT / name / "__init__.py").is_file() for name in PACKAGE_FOLDERS)


def test_this_test_process_has_the_installed_distributions():
    assert set(SHADOWED_DISTRIBUTIONS) == set(PACKAGE_FOLDERS) & INSTALLED
    for name in SHADOWED_DISTRIBUTIONS:
        assert Path(sys.modules[name].__file__).resolve() != REPO_ROOT / name / "__init__.py", name
    import transformers.integrations.hub_kernels  # raises ImportError where kernels/ stood in for `kernels`

    assert transformers.integrations.hub_kernels.__name__ == "transformers.integrations.hub_kernels"


def test_a_process_started_in_the_checkout_gets_the_distributions_once_they_are_imported():
    found = _in_checkout("""
        import importlib.util, json
        before = importlib.util.find_spec("kernels").origin
        from megaserve.replicas.source_tree import import_installed_namesakes
        shadowed = import_installed_namesakes()
        import kernels
        import transformers.integrations.hub_kernels
        print(json.dumps({"before": before, "shadowed": shadowed, "after": kernels.__file__}))
    """)
    assert Path(found["before"]) == REPO_ROOT / "kernels" / "__init__.py"  # the folder hides the distribution
    assert set(found["shadowed"]) == set(PACKAGE_FOLDERS) & INSTALLED
    assert (Path(found["after"]) != REPO_ROOT / "kernels" / "__init__.py") is KERNELS_INSTALLED


def test_a_process_it_spawns_imports_the_distributions_too():
    """SGLang starts its scheduler with multiprocessing's spawn, whose child gets this sys.path and
    none of these sys.modules; transformers' import of `kernels` there is the one that must work."""
    found = _in_checkout("""
        import json, importlib, multiprocessing, os, sys
        from megaserve.replicas.source_tree import import_installed_namesakes
        import_installed_namesakes()
        child = multiprocessing.get_context("spawn").Process(
            target=importlib.import_module, args=("transformers.integrations.hub_kernels",))
        child.start(), child.join()
        print(json.dumps({"exitcode": child.exitcode, "last": os.path.abspath(sys.path[-1])}))
    """)
    assert found["exitcode"] == 0
    assert found["last"] == str(REPO_ROOT)


def test_a_folder_imported_already_gives_way_to_the_distribution():
    found = _in_checkout("""
        import json, kernels
        before = kernels.__file__
        from megaserve.replicas.source_tree import import_installed_namesakes
        import_installed_namesakes()
        import kernels
        print(json.dumps({"before": before, "after": kernels.__file__}))
    """)
    assert Path(found["before"]) == REPO_ROOT / "kernels" / "__init__.py"
    assert (found["after"] != found["before"]) is KERNELS_INSTALLED


def test_nothing_is_imported_where_the_checkout_is_not_on_sys_path(tmp_path):
    found = _in_checkout("""
        import json, sys
        from megaserve.replicas.source_tree import import_installed_namesakes
        print(json.dumps({"shadowed": import_installed_namesakes(), "kernels": "kernels" in sys.modules}))
    """, cwd=tmp_path)
    assert found == {"shadowed": [], "kernels": False}


def test_the_sglang_engine_imports_them_before_sglang():
    found = _in_checkout("""
        import json, sys
        from megaserve.replicas.engines.sglang_engine import _sglang_engine_class
        try:
            _sglang_engine_class()
        except RuntimeError as error:  # no SGLang here: its import comes after the distributions'
            refused = str(error)
        print(json.dumps({"refused": refused, "kernels": getattr(sys.modules.get("kernels"), "__file__", None)}))
    """)
    assert "the sglang engine needs SGLang" in found["refused"]
    if KERNELS_INSTALLED:
        assert Path(found["kernels"]) != REPO_ROOT / "kernels" / "__init__.py"


def test_a_distribution_that_does_not_import_is_left_out_with_a_warning(monkeypatch, caplog):
    """An installed `router` whose import fails: reported, the others still imported, nothing raised
    (`kernels` here where it is installed, and also reported where it is not)."""
    importer = importlib.import_module

    def import_module(name):
        if name == "router":
            raise ImportError("a broken install")
        return importer(name)

    monkeypatch.setattr(source_tree.importlib.metadata, "packages_distributions",
                        lambda: {"router": ["broken-router"], "kernels": ["kernels"]})
    monkeypatch.setattr(source_tree.importlib, "import_module", import_module)
    monkeypatch.delitem(sys.modules, "router", raising=False)
    assert import_installed_namesakes(REPO_ROOT) == (["kernels"] if KERNELS_INSTALLED else [])
    assert "the installed 'router' (broken-router) does not import: a broken install" in caplog.text
