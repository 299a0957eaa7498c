"""What a checkout of the repository must not do to the Python environment it is used in.

``python -m pytest`` and ``python -c`` put the working directory first on ``sys.path``, so from a
checkout's root every top-level folder holding an ``__init__.py`` (and every top-level ``.py``
file) is importable under its own name, ahead of the installed packages. A top-level ``kernels/``
package did exactly that to Hugging Face's ``kernels``, which transformers imports when diffusers
loads its PEFT support: every model import failed from the root with transformers 5.25.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def _top_level_files() -> list[str]:
    """The checkout's files as paths relative to its root: those git tracks (a developer's scratch
    files are not the repository's); without git, the root's files and its folders' __init__.py."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout:
        return listed.stdout.splitlines()
    names = os.listdir(ROOT)
    return names + [f"{n}/__init__.py" for n in names if os.path.isfile(os.path.join(ROOT, n, "__init__.py"))]


def test_the_only_top_level_package_of_the_checkout_is_fsattn_diffusers():
    files = _top_level_files()
    packages = sorted({path.split("/")[0] for path in files if path.count("/") == 1 and path.endswith("/__init__.py")})
    modules = sorted(path for path in files if "/" not in path and path.endswith(".py"))
    assert packages == ["fsattn_diffusers"] and modules == [], (
        f"top-level packages {packages} and modules {modules} of the checkout would shadow installed ones of the "
        "same name from its root; put them under fsattn_diffusers/ (or a folder without __init__.py)")


def test_from_the_checkout_root_kernels_is_not_a_folder_of_the_checkout():
    code = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s and s.origin else '')"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}  # it would keep the root off sys.path
    origin = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            check=True).stdout.strip()
    origin = os.path.realpath(origin) if origin else origin
    # Hugging Face's package where it is installed (a virtual environment may sit in the checkout),
    # or nothing; never the checkout's own kernels/ folder or kernels.py.
    assert origin not in (os.path.join(ROOT, "kernels", "__init__.py"), os.path.join(ROOT, "kernels.py")), (
        f"'import kernels' from the checkout's root finds {origin}")
