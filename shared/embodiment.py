"""Embodiment modality configs: which keys of a dataset a GR00T N1.6 model reads, at which delta
indices, and how each state/action key is represented and normalised.

The form is Isaac-GR00T's (`gr00t/data/types.py` ModalityConfig / ActionConfig): per embodiment tag, one
config per modality (video, state, action, language) with `delta_indices`, `modality_keys`, the
state keys encoded as sin/cos, the keys normalised by mean/std, and per action key its representation
(RELATIVE to the current state, or ABSOLUTE), type (EEF or NON_EEF), format (DEFAULT, XYZ_ROT6D,
XYZ_ROTVEC) and the state key a relative action is taken against (default: the same key).

Where a config comes from (`resolve_config`):
  * a registered tag (N1.6's post-train embodiments, `REGISTERED`), or
  * the user's file (`--modality-config FILE`): the JSON form Isaac-GR00T's `to_json_serializable`
    writes (one config, or `{tag: config}`), or Isaac-GR00T's Python form (a file that builds
    ModalityConfig / ActionConfig objects and calls `register_modality_config(config, embodiment_tag=...)`,
    as `--modality_config_path` takes). The Python form is read with `ast`, never executed: literals,
    those constructors, the enums, `list(range(...))` and names bound earlier in the file.

`key_layout` then ties the config's keys to one dataset: each state/action key to a slice of a stored
episode array (from the dataset's `meta/modality.json`: `start`, `end`, `original_key`), each video key
to a camera slot, the language key to the array of task indices. Preprocess records config + layout
in the shard index; nothing else is needed to train, evaluate, export or serve.
"""

from __future__ import annotations

import ast
import json
import os
from dataclasses import dataclass

from loongforge.shared.errors import ConfigError

MODALITIES = ("video", "state", "action", "language")
REPRESENTATIONS = ("RELATIVE", "DELTA", "ABSOLUTE")  # DELTA is carried as Isaac-GR00T does: not converted
ACTION_TYPES = ("EEF", "NON_EEF")
ACTION_FORMATS = ("DEFAULT", "XYZ_ROT6D", "XYZ_ROTVEC")
STATE_COLUMN, ACTION_COLUMN = "observation.state", "action"

# Isaac-GR00T's EMBODIMENT_TAG_TO_PROJECTOR_INDEX: each index selects one slice of N1.6's
# category-specific encoders and decoder.
PROJECTOR_INDEX = {
    "robocasa_panda_omron": 13,
    "gr1": 20,
    "behavior_r1_pro": 24,
    "unitree_g1": 8,
    "libero_panda": 2,
    "oxe_google": 0,
    "oxe_widowx": 1,
    "oxe_droid": 16,
    "new_embodiment": 10,
}


@dataclass(frozen=True, slots=True)
class ActionConfig:
    rep: str = "ABSOLUTE"
    type: str = "NON_EEF"
    format: str = "DEFAULT"
    state_key: str | None = None

    def __post_init__(self):
        for name, value, allowed in (("rep", self.rep, REPRESENTATIONS), ("type", self.type, ACTION_TYPES),
                                     ("format", self.format, ACTION_FORMATS)):
            if value not in allowed:
                raise ConfigError(f"action config: {name} {value!r} not in {allowed}")
        if self.type == "NON_EEF" and self.format != "DEFAULT":
            raise ConfigError(f"action config: a NON_EEF action has format DEFAULT, not {self.format}")

    @property
    def relative(self) -> bool:
        return self.rep == "RELATIVE"

    def to_json(self) -> dict:
        return {"rep": self.rep, "type": self.type, "format": self.format, "state_key": self.state_key}


@dataclass(frozen=True, slots=True)
class ModalityConfig:
    delta_indices: tuple[int, ...]
    modality_keys: tuple[str, ...]
    sin_cos_embedding_keys: tuple[str, ...] | None = None
    mean_std_embedding_keys: tuple[str, ...] | None = None
    action_configs: tuple[ActionConfig, ...] | None = None

    def __post_init__(self):
        if not self.delta_indices or not self.modality_keys:
            raise ConfigError("modality config: delta_indices and modality_keys must be non-empty")
        if len(set(self.modality_keys)) != len(self.modality_keys):
            raise ConfigError(f"modality config: a key appears twice in {list(self.modality_keys)}")
        if self.action_configs is not None and len(self.action_configs) != len(self.modality_keys):
            raise ConfigError(f"modality config: {len(self.action_configs)} action configs for "
                              f"{len(self.modality_keys)} keys {list(self.modality_keys)}")
        for name in ("sin_cos_embedding_keys", "mean_std_embedding_keys"):
            unknown = sorted(set(getattr(self, name) or ()) - set(self.modality_keys))
            if unknown:
                raise ConfigError(f"modality config: {name} {unknown} are not among modality_keys "
                                  f"{list(self.modality_keys)}")

    def action_config(self, key: str) -> ActionConfig:
        """The key's action config; ABSOLUTE NON_EEF when the config gives none (Isaac-GR00T's default)."""
        if self.action_configs is None:
            return ActionConfig()
        return self.action_configs[self.modality_keys.index(key)]

    def to_json(self) -> dict:
        opt = lambda v: None if v is None else list(v)  # noqa: E731
        return {"delta_indices": list(self.delta_indices), "modality_keys": list(self.modality_keys),
                "sin_cos_embedding_keys": opt(self.sin_cos_embedding_keys),
                "mean_std_embedding_keys": opt(self.mean_std_embedding_keys),
                "action_configs": None if self.action_configs is None else [a.to_json() for a in self.action_configs]}

    @classmethod
    def from_json(cls, doc, where: str) -> "ModalityConfig":
        if not isinstance(doc, dict):
            raise ConfigError(f"{where}: a modality config object was expected, found {type(doc).__name__}")
        known = {"delta_indices", "modality_keys", "sin_cos_embedding_keys", "mean_std_embedding_keys",
                 "action_configs"}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown fields {unknown}; a modality config has {sorted(known)}")
        try:
            acts = doc.get("action_configs")
            return cls(delta_indices=tuple(int(d) for d in doc["delta_indices"]),
                       modality_keys=tuple(str(k) for k in doc["modality_keys"]),
                       sin_cos_embedding_keys=_strings(doc.get("sin_cos_embedding_keys")),
                       mean_std_embedding_keys=_strings(doc.get("mean_std_embedding_keys")),
                       action_configs=None if acts is None else tuple(_action(a, where) for a in acts))
        except KeyError as exc:
            raise ConfigError(f"{where}: missing {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise ConfigError(f"{where}: {exc}") from None
            raise ConfigError(f"{where}: malformed ({exc})") from None


def _strings(v) -> tuple[str, ...] | None:
    return None if v is None else tuple(str(x) for x in v)


def _action(doc, where: str) -> ActionConfig:
    if isinstance(doc, ActionConfig):
        return doc
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: an action config object was expected, found {doc!r}")
    unknown = sorted(set(doc) - {"rep", "type", "format", "state_key"})
    if unknown:
        raise ConfigError(f"{where}: action config has unknown fields {unknown}")
    return ActionConfig(rep=str(doc.get("rep", "ABSOLUTE")).upper(), type=str(doc.get("type", "NON_EEF")).upper(),
                        format=str(doc.get("format", "DEFAULT")).upper(), state_key=doc.get("state_key"))


@dataclass(frozen=True, slots=True)
class EmbodimentConfig:
    video: ModalityConfig
    state: ModalityConfig
    action: ModalityConfig
    language: ModalityConfig

    def __post_init__(self):
        if len(self.language.modality_keys) != 1:
            raise ConfigError(f"modality config: one language key expected, got {list(self.language.modality_keys)}")
        h = self.action.delta_indices
        if list(h) != list(range(h[0], h[0] + len(h))):
            raise ConfigError(f"modality config: action delta_indices {list(h)} must be consecutive (t+d0 .. "
                              "t+d0+H-1): the action chunk is a run of frames")
        if self.state.delta_indices[-1] != h[0]:
            raise ConfigError(f"modality config: the last state delta ({self.state.delta_indices[-1]}) must equal "
                              f"the first action delta ({h[0]}): relative actions are taken against that state")
        for key in self.action.modality_keys:
            ref = self.action.action_config(key)
            if ref.relative and (ref.state_key or key) not in self.state.modality_keys:
                raise ConfigError(f"modality config: relative action {key!r} is taken against state key "
                                  f"{ref.state_key or key!r}, which is not among the state keys "
                                  f"{list(self.state.modality_keys)}")

    @property
    def horizon(self) -> int:
        return len(self.action.delta_indices)

    def to_json(self) -> dict:
        return {m: getattr(self, m).to_json() for m in MODALITIES}

    @classmethod
    def from_json(cls, doc, where: str = "modality config") -> "EmbodimentConfig":
        if not isinstance(doc, dict):
            raise ConfigError(f"{where}: a JSON object was expected")
        missing = [m for m in MODALITIES if m not in doc]
        if missing:
            raise ConfigError(f"{where}: no {missing} modality; a config has {list(MODALITIES)}")
        return cls(**{m: ModalityConfig.from_json(doc[m], f"{where}: {m}") for m in MODALITIES})


def _m(deltas, keys, sin_cos=None, mean_std=None, actions=None) -> ModalityConfig:
    return ModalityConfig(tuple(deltas), tuple(keys), None if sin_cos is None else tuple(sin_cos),
                          None if mean_std is None else tuple(mean_std),
                          None if actions is None else tuple(ActionConfig(*a) for a in actions))


_REL, _ABS = ("RELATIVE", "NON_EEF", "DEFAULT"), ("ABSOLUTE", "NON_EEF", "DEFAULT")
_TASK = ("annotation.human.action.task_description",)
_XYZRPY = ("x", "y", "z", "roll", "pitch", "yaw")
# N1.6's pre-registered post-train embodiments (Isaac-GR00T gr00t/configs/data/embodiment_configs.py).
REGISTERED: dict[str, EmbodimentConfig] = {
    "unitree_g1": EmbodimentConfig(
        video=_m([0], ["ego_view"]),
        state=_m([0], ["left_leg", "right_leg", "waist", "left_arm", "right_arm", "left_hand", "right_hand"]),
        action=_m(range(30), ["left_arm", "right_arm", "left_hand", "right_hand", "waist", "base_height_command",
                              "navigate_command"], actions=[_REL, _REL, _ABS, _ABS, _ABS, _ABS, _ABS]),
        language=_m([0], ["annotation.human.task_description"])),
    "libero_panda": EmbodimentConfig(
        video=_m([0], ["image", "wrist_image"]), state=_m([0], [*_XYZRPY, "gripper"]),
        action=_m(range(16), [*_XYZRPY, "gripper"]), language=_m([0], _TASK)),
    "oxe_widowx": EmbodimentConfig(
        video=_m([0], ["image_0"]), state=_m([0], [*_XYZRPY, "pad", "gripper"]),
        action=_m(range(8), [*_XYZRPY, "gripper"], mean_std=_XYZRPY), language=_m([0], _TASK)),
    "oxe_google": EmbodimentConfig(
        video=_m([0], ["image"]), state=_m([0], ["x", "y", "z", "rx", "ry", "rz", "rw", "gripper"]),
        action=_m(range(8), [*_XYZRPY, "gripper"], mean_std=_XYZRPY), language=_m([0], _TASK)),
    "behavior_r1_pro": EmbodimentConfig(
        video=_m([0], ["observation.images.rgb.head_256_256", "observation.images.rgb.left_wrist_256_256",
                       "observation.images.rgb.right_wrist_256_256"]),
        state=_m([0], ["robot_pos", "robot_ori_cos", "robot_ori_sin", "robot_2d_ori", "robot_2d_ori_cos",
                       "robot_2d_ori_sin", "robot_lin_vel", "robot_ang_vel", "arm_left_qpos", "arm_left_qpos_sin",
                       "arm_left_qpos_cos", "eef_left_pos", "eef_left_quat", "gripper_left_qpos", "arm_right_qpos",
                       "arm_right_qpos_sin", "arm_right_qpos_cos", "eef_right_pos", "eef_right_quat",
                       "gripper_right_qpos", "trunk_qpos"]),
        action=_m(range(32), ["base", "torso", "left_arm", "left_gripper", "right_arm", "right_gripper"],
                  actions=[_ABS, (*_REL, "trunk_qpos"), (*_REL, "arm_left_qpos"), _ABS, (*_REL, "arm_right_qpos"),
                           _ABS]),
        language=_m([0], ["annotation.human.coarse_action"])),
    "oxe_droid": EmbodimentConfig(
        video=_m([0], ["exterior_image_1_left", "wrist_image_left"]),
        state=_m([0], ["joint_position", "gripper_position"]),
        action=_m(range(32), ["joint_position", "gripper_position"], actions=[_REL, _ABS]),
        language=_m([0], ["annotation.language.language_instruction"])),
}


def projector_index(tag: str, max_num_embodiments: int | None = None) -> int:
    """A GR00T embodiment tag (or a projector index as digits) -> the projector index, checked."""
    if tag in PROJECTOR_INDEX:
        idx = PROJECTOR_INDEX[tag]
    elif tag.isdigit():
        idx = int(tag)
    else:
        raise ConfigError(f"embodiment tag {tag!r}: use one of {', '.join(PROJECTOR_INDEX)} or a projector index")
    if max_num_embodiments is not None and idx >= max_num_embodiments:
        raise ConfigError(f"embodiment tag {tag!r} is projector {idx}, the model has {max_num_embodiments}")
    return idx


def tag_of(index: int) -> str:
    return next((t for t, i in PROJECTOR_INDEX.items() if i == index), str(index))


# ---- the user's file -------------------------------------------------------------------------------
def load_config_file(path: str) -> dict[str, EmbodimentConfig]:
    """`--modality-config FILE` -> {tag: config}: JSON (one config, or {tag: config}) or Isaac-GR00T's
    Python form (configs registered with register_modality_config; new_embodiment when no tag is given)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--modality-config {path}: cannot read it ({exc})") from None
    if path.endswith(".py"):
        return _PythonConfig(path).read(text)
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--modality-config {path}: not JSON ({exc}); give a .json file (Isaac-GR00T's "
                          "to_json_serializable form) or a .py file (its Python form)") from None
    if isinstance(doc, dict) and "video" in doc and "action" in doc:
        return {"new_embodiment": EmbodimentConfig.from_json(doc, f"--modality-config {path}")}
    if not isinstance(doc, dict) or not doc:
        raise ConfigError(f"--modality-config {path}: a config object or {{tag: config}} was expected")
    return {str(t): EmbodimentConfig.from_json(c, f"--modality-config {path}: {t}") for t, c in doc.items()}


def resolve_config(tag: str, path: str | None = None) -> EmbodimentConfig:
    """The config of `tag`: from the user's file when it has one for the tag, else the registered one."""
    if path is not None:
        found = load_config_file(path)
        if tag in found:
            return found[tag]
        if len(found) == 1 and tag not in REGISTERED:
            return next(iter(found.values()))
        raise ConfigError(f"--modality-config {os.path.basename(path)} has configs for {sorted(found)}, not for "
                          f"--embodiment-tag {tag}")
    if tag in REGISTERED:
        return REGISTERED[tag]
    raise ConfigError(f"--embodiment-tag {tag}: no registered modality config (registered: {', '.join(REGISTERED)}); "
                      "give --modality-config FILE (Isaac-GR00T's JSON or Python form)")


class _PythonConfig:
    """Isaac-GR00T's Python modality-config files, evaluated from their syntax tree (nothing runs)."""

    ENUMS = {"ActionRepresentation": REPRESENTATIONS, "ActionType": ACTION_TYPES, "ActionFormat": ACTION_FORMATS}

    def __init__(self, path: str):
        self.path, self.names, self.registered = path, {}, {}

    def fail(self, node, what: str):
        line = getattr(node, "lineno", "?")
        raise ConfigError(f"--modality-config {self.path}:{line}: {what}; the Python form is read, not run: use "
                          "literals, ModalityConfig/ActionConfig, the enums, list(range(n)) and names bound above")

    def read(self, text: str) -> dict[str, EmbodimentConfig]:
        try:
            tree = ast.parse(text, self.path)
        except SyntaxError as exc:
            raise ConfigError(f"--modality-config {self.path}:{exc.lineno}: not Python ({exc.msg})") from None
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)) or (
                    isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
                continue  # imports name the Isaac-GR00T types we already know; a docstring
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                self.names[node.targets[0].id] = self.value(node.value)
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and \
                    self.callee(node.value) == "register_modality_config":
                self.register(node.value)
            else:
                self.fail(node, f"a {type(node).__name__} statement")
        if not self.registered:
            self.fail(tree, "no register_modality_config(config, embodiment_tag=...) call")
        return self.registered

    @staticmethod
    def callee(call: ast.Call) -> str:
        f = call.func
        return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""

    def register(self, call: ast.Call) -> None:
        args = [self.value(a) for a in call.args]
        kw = {k.arg: self.value(k.value) for k in call.keywords}
        config = args[0] if args else kw.get("config")
        tag = args[1] if len(args) > 1 else kw.get("embodiment_tag", "new_embodiment")
        if not isinstance(config, dict):
            self.fail(call, "register_modality_config takes a dict of modality -> ModalityConfig")
        self.registered[str(tag)] = EmbodimentConfig.from_json(
            {m: (v.to_json() if isinstance(v, ModalityConfig) else v) for m, v in config.items()},
            f"--modality-config {self.path}")

    def value(self, node):  # noqa: C901 - one branch per node kind the form uses
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self.value(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            return {self.value(k): self.value(v) for k, v in zip(node.keys, node.values)}
        if isinstance(node, ast.Name):
            if node.id in self.names:
                return self.names[node.id]
            if node.id == "None":
                return None
            self.fail(node, f"unknown name {node.id!r}")
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -self.value(node.operand)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner, member = node.value.id, node.attr
            if owner in self.ENUMS and member in self.ENUMS[owner]:
                return member
            if owner == "EmbodimentTag":
                return member.lower()
            self.fail(node, f"unknown value {owner}.{member}")
        if isinstance(node, ast.Call):
            return self.call(node)
        self.fail(node, f"an expression of kind {type(node).__name__}")

    def call(self, node: ast.Call):
        name = self.callee(node)
        args = [self.value(a) for a in node.args]
        kw = {k.arg: self.value(k.value) for k in node.keywords}
        if name == "range":
            return list(range(*args))
        if name in ("list", "tuple") and len(args) == 1:
            return list(args[0])
        if name == "ActionConfig":
            fields = dict(zip(("rep", "type", "format", "state_key"), args), **kw)
            return {k: v for k, v in fields.items()}
        if name == "ModalityConfig":
            fields = dict(zip(("delta_indices", "modality_keys", "sin_cos_embedding_keys", "mean_std_embedding_keys",
                               "action_configs"), args), **kw)
            return ModalityConfig.from_json(fields, f"--modality-config {self.path}:{node.lineno}")
        if name == "EmbodimentTag" and len(args) == 1:
            return str(args[0])
        self.fail(node, f"a call of {name or 'an expression'}")


def derive_config(modality: dict, camera_slots, horizon: int) -> EmbodimentConfig:
    """new_embodiment's config for a dataset that brings none: every camera, every state and action
    group of its modality.json (in its order), absolute, min/max; the task as the language key."""
    videos = list(modality.get("video") or {}) or list(camera_slots)
    notes = [f"annotation.{k}" for k in (modality.get("annotation") or {})]
    language = notes[0] if notes else "annotation.human.action.task_description"
    m = lambda deltas, keys: ModalityConfig(tuple(deltas), tuple(keys))  # noqa: E731
    return EmbodimentConfig(video=m([0], videos), state=m([0], list(modality.get("state") or {})),
                            action=m(range(horizon), list(modality.get("action") or {})), language=m([0], [language]))


def plain_modality(state_dim: int, action_dim: int, slots) -> dict:
    """A modality.json of one "state" and one "action" group (a dataset that names none)."""
    return {"state": {"state": {"start": 0, "end": state_dim}}, "action": {"action": {"start": 0, "end": action_dim}},
            "video": {s: {"original_key": f"observation.images.{s}"} for s in slots}, "annotation": {}}


# ---- one dataset's keys ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KeySlice:
    """Where a state/action key lives in an episode: columns [start, end) of the stored array `array`."""

    array: str
    start: int
    end: int

    @property
    def dim(self) -> int:
        return self.end - self.start

    def to_json(self) -> dict:
        return {"array": self.array, "start": self.start, "end": self.end}


def key_layout(config: EmbodimentConfig, modality: dict, arrays: dict[str, str], dims: dict[str, int],
               slots: dict[str, str], origin: str) -> dict:
    """The config's keys against one dataset -> {"state"|"action": {key: KeySlice}, "video": {key: slot},
    "language": {key: array}} (ConfigError naming the key and what the dataset has).

    modality: the dataset's meta/modality.json; arrays: source column -> stored episode array
    (observation.state -> state, action -> action, task_index -> task_index, other columns -> col_*);
    dims: stored array -> width; slots: camera key (observation.images.x) -> slot."""
    out: dict = {"state": {}, "action": {}, "video": {}, "language": {}}
    for kind in ("state", "action"):
        groups = modality.get(kind) or {}
        default = STATE_COLUMN if kind == "state" else ACTION_COLUMN
        for key in getattr(config, kind).modality_keys:
            g = groups.get(key)
            if not isinstance(g, dict) or "start" not in g or "end" not in g:
                raise ConfigError(f"{origin}: {kind} key {key!r} of the modality config is not in meta/modality.json "
                                  f"(its {kind} keys: {sorted(groups)})")
            column = str(g.get("original_key") or default)
            array = arrays.get(column)
            if array is None:
                raise ConfigError(f"{origin}: {kind} key {key!r} reads column {column!r}, which the dataset does not "
                                  f"have as a float feature (columns: {sorted(arrays)})")
            start, end = int(g["start"]), int(g["end"])
            if not 0 <= start < end <= dims.get(array, 0):
                raise ConfigError(f"{origin}: {kind} key {key!r} is [{start}:{end}] of {column!r}, which has "
                                  f"{dims.get(array, 0)} values")
            out[kind][key] = KeySlice(array, start, end)
    videos = modality.get("video") or {}
    for key in config.video.modality_keys:
        g = videos.get(key)
        column = str((g or {}).get("original_key") or f"observation.images.{key}")
        if column not in slots:
            raise ConfigError(f"{origin}: video key {key!r} reads camera {column!r}, which the dataset does not have "
                              f"(cameras: {sorted(slots)})")
        out["video"][key] = slots[column]
    notes = modality.get("annotation") or {}
    for key in config.language.modality_keys:
        short = key[len("annotation."):] if key.startswith("annotation.") else key
        g = notes.get(short)
        column = str((g or {}).get("original_key") or key) if g is not None else None
        if column is None:
            if key in arrays:
                column = key
            elif notes:
                raise ConfigError(f"{origin}: language key {key!r} is not in meta/modality.json's annotations "
                                  f"({sorted('annotation.' + k for k in notes)})")
            else:
                column = "task_index"  # no annotations listed: the task LeRobot gives every frame
        if column not in arrays:
            raise ConfigError(f"{origin}: language key {key!r} reads column {column!r}, which the dataset lacks")
        out["language"][key] = arrays[column]
    return out


def layout_to_json(layout: dict) -> dict:
    return {k: ({n: s.to_json() for n, s in v.items()} if k in ("state", "action") else dict(v))
            for k, v in layout.items()}


def layout_from_json(doc: dict) -> dict:
    return {k: ({n: KeySlice(**s) for n, s in v.items()} if k in ("state", "action") else dict(v))
            for k, v in doc.items()}
