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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_only_top_level_package_of_the_checkout_is_fsattn_diffusers():
    packages = sorted(name for name in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, name, "__init__.py")))
    modules = sorted(name for name in os.listdir(ROOT) if name.endswith(".py"))
    assert packages == ["fsattn_diffusers"] and modules == [], (
        f"top-level packages {packages} and modules {modules} of the checkout would shadow installed ones of the "
        "same name from its root; put them under fsattn_diffusers/ (or a folder without __init__.py)")


def test_from_the_checkout_root_kernels_is_not_a_folder_of_the_checkout():
    code = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s and s.origin else '')"
    origin = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    # Hugging Face's package where it is installed (a virtual environment may sit in the checkout),
    # or nothing; never the checkout's own kernels/ folder or kernels.py.
    assert origin not in (os.path.join(ROOT, "kernels", "__init__.py"), os.path.join(ROOT, "kernels.py")), (
        f"'import kernels' from the checkout's root finds {origin}")
