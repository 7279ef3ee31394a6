"""LoongForge: fast training of multimodal embodied-AI models."""

import os as _os

__version__ = "0.1.0"

# A source checkout used without installing it (the offline GPU check, infra/gpu/check.sh, puts the
# checkout on PYTHONPATH): the services live beside this folder, as pyproject.toml's package-dir
# mapping says (loongforge.shared = shared/, loongforge.train = train/, ...). Installed, nothing changes.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "pyproject.toml")) and _os.path.isdir(_os.path.join(_checkout, "shared")):
    __path__.append(_checkout)
