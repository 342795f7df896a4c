"""The test process imports installed distributions, not the repository's folders of the same name."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT, SHADOWED_DISTRIBUTIONS


def test_a_distribution_named_like_a_folder_of_the_repository_is_imported_from_where_it_is_installed():
    installed = importlib.metadata.packages_distributions()
    for name in ("kernels", "router", "deploy", "replicas", "monitoring"):
        assert (name in SHADOWED_DISTRIBUTIONS) is (name in installed), name
    for name in SHADOWED_DISTRIBUTIONS:
        assert Path(sys.modules[name].__file__).resolve() != REPO_ROOT / name / "__init__.py", name


def test_transformers_hub_kernels_import_with_the_repository_on_sys_path():
    """transformers (5.25 on) runs `from kernels import CUDAProperties, ...` whenever the `kernels`
    distribution is installed, and the repository's kernels/ has no such names."""
    assert str(REPO_ROOT) in [str(Path(entry or ".").resolve()) for entry in sys.path]
    import transformers.integrations.hub_kernels as hub_kernels

    assert hub_kernels.__name__ == "transformers.integrations.hub_kernels"
