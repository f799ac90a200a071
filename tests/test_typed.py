"""A user's own code is type-checked against rangefinder's annotations (PEP 561)."""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def test_mypy_reads_the_installed_package_s_annotations():
    """mypy's own module finder, on the package as installed (the source folder as site-packages): without the
    py.typed marker it skipped rangefinder ("module is installed, but missing library stubs or py.typed marker"),
    and a notebook's calls of run_<step>() or analyze_lr_curve() were checked against nothing."""
    from mypy.fscache import FileSystemCache
    from mypy.modulefinder import FindModuleCache, SearchPaths
    from mypy.options import Options

    finder = FindModuleCache(SearchPaths((), (), (str(SRC),), ()), FileSystemCache(), Options())
    found = finder.find_module("rangefinder.analysis")
    assert found == str(SRC / "rangefinder" / "analysis" / "__init__.py"), found
