"""Camera frames on the fleet's wire: one compact binary body for an observation or an episode.

    body = MAGIC (4 bytes) | header length (uint32, little-endian) | header (UTF-8 JSON)
           | payload (header["payload_bytes"] bytes; an episode's Arrow IPC table, else none)
           | each camera's frames, raw uint8 in C order, in the header's "cameras" order

    header["cameras"] = [{"key": "observation.images.gripper", "shape": [64, 64, 3], "dtype": "uint8"}, ...]

    an observation (POST /v1/act, Content-Type OBS_TYPE, MAGIC b"FLO1"):
        header["obs"] = the state, n JSON numbers; each camera's shape is (H, W, 3)
    an episode (POST /v1/episodes and a robot's spool entry, Content-Type EPISODE_TYPE, MAGIC b"FLE1"):
        the payload is the episode's frame table (Arrow IPC); each camera's shape is (T, H, W, 3)

Two 64x64 cameras make a 24.6 kB observation body that decodes with two ``np.frombuffer`` views
(no copy, no per-number parsing), where a JSON list of their 24,576 numbers is ~100 kB to print
and parse. The state stays JSON: 11 numbers, validated exactly as a state request's are.
Decoding never trusts the sender: every size is checked against the body before it is read;
a problem raises ``WireError`` naming the field and the fix (the services answer it as a 4xx).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

OBS_TYPE = "application/x-fleetloop-obs"
EPISODE_TYPE = "application/x-fleetloop-episode"
OBS_MAGIC = b"FLO1"
EPISODE_MAGIC = b"FLE1"
MAX_HEADER_BYTES = 256 * 1024  # the header is the state and a few camera entries: far below this
_LENGTH = struct.Struct("<I")
_PREFIX = len(OBS_MAGIC) + _LENGTH.size
FORMAT_FIX = "encode the body with components.fleet.camera_wire (encode_obs / encode_episode)"


class WireError(ValueError):
    """A body that is not a well-formed camera body: which field, why, and the fix."""

    def __init__(self, field: str, reason: str, fix: str = FORMAT_FIX) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason, self.fix = field, reason, fix


@dataclass(frozen=True)
class Framed:
    header: dict
    payload: bytes = b""
    frames: dict[str, np.ndarray] = field(default_factory=dict)  # read-only views into the body


def encode(magic: bytes, header: dict, frames: Mapping[str, np.ndarray], payload: bytes = b"") -> bytes:
    """``frames`` (key -> uint8 array) and ``payload`` behind a JSON ``header`` (see the module doc)."""
    arrays = {key: np.ascontiguousarray(value) for key, value in frames.items()}
    for key, value in arrays.items():
        if value.dtype != np.uint8:
            raise ValueError(f"camera {key!r}: frames are {value.dtype}; send uint8 RGB frames")
    cameras = [{"key": key, "shape": list(value.shape), "dtype": "uint8"} for key, value in arrays.items()]
    head = json.dumps({**header, "payload_bytes": len(payload), "cameras": cameras}, separators=(",", ":")).encode()
    return b"".join([magic, _LENGTH.pack(len(head)), head, payload, *(a.tobytes() for a in arrays.values())])


def decode(magic: bytes, body: bytes, what: str) -> Framed:
    """The header, payload and frames of a body made by ``encode``; ``WireError`` if malformed."""
    if body[: len(magic)] != magic:
        raise WireError("body", f"not a {what} body (it starts {bytes(body[:4])!r}, expected {magic!r})")
    if len(body) < _PREFIX:
        raise WireError("body", f"{len(body)} bytes: shorter than the {_PREFIX}-byte prefix")
    (head_len,) = _LENGTH.unpack_from(body, len(magic))
    if head_len > min(MAX_HEADER_BYTES, len(body) - _PREFIX):
        raise WireError("header", f"declares {head_len} bytes; the body has {len(body) - _PREFIX} after the prefix")
    try:
        header = json.loads(body[_PREFIX: _PREFIX + head_len])
    except (ValueError, RecursionError) as exc:
        raise WireError("header", f"not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise WireError("header", f"a JSON {type(header).__name__}, not an object")
    offset = _PREFIX + head_len
    payload_len = header.get("payload_bytes", 0)
    if not isinstance(payload_len, int) or isinstance(payload_len, bool) or not 0 <= payload_len <= len(body) - offset:
        raise WireError("payload_bytes", f"{str(payload_len)[:32]} does not fit the {len(body) - offset} bytes left")
    payload = bytes(body[offset: offset + payload_len])
    frames, offset = _frames(header.get("cameras", []), body, offset + payload_len)
    if offset != len(body):
        raise WireError("body", f"{len(body) - offset} bytes after the last camera's frames")
    return Framed(header, payload, frames)


def _frames(cameras: object, body: bytes, offset: int) -> tuple[dict[str, np.ndarray], int]:
    if not isinstance(cameras, list):
        raise WireError("cameras", "not a list of {key, shape, dtype} entries")
    frames: dict[str, np.ndarray] = {}
    for i, entry in enumerate(cameras):
        key, shape = _camera_entry(entry, i)
        if key in frames:
            raise WireError(f"cameras[{i}].key", f"camera {key!r} twice", "send each camera once")
        size = math.prod(shape)  # Python ints: a forged shape cannot overflow past the check
        if size > len(body) - offset:
            raise WireError(f"cameras[{key}].shape", f"{shape} needs {size} bytes; {len(body) - offset} are left",
                            "send each camera's frames whole, in the header's order")
        frames[key] = np.frombuffer(body, np.uint8, size, offset).reshape(shape)
        offset += size
    return frames, offset


def _camera_entry(entry: object, i: int) -> tuple[str, tuple[int, ...]]:
    if not isinstance(entry, dict) or not isinstance(entry.get("key"), str):
        raise WireError(f"cameras[{i}]", "not an object with a string key")
    key, shape = entry["key"], entry.get("shape")
    if entry.get("dtype") != "uint8":
        raise WireError(f"cameras[{key}].dtype", f"{str(entry.get('dtype'))[:32]!r}", "send uint8 RGB frames (0..255)")
    if not isinstance(shape, list) or not shape or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                          for d in shape):
        raise WireError(f"cameras[{key}].shape", f"{str(shape)[:64]} is not a list of sizes",
                        "give the frames' shape, e.g. [64, 64, 3]")
    return key, tuple(shape)


# -- an observation: the state and one frame per camera -----------------------------------------
def encode_obs(state: np.ndarray, images: Mapping[str, np.ndarray]) -> bytes:
    """One robot's observation: its state (n,) and each camera's (H, W, 3) uint8 frame."""
    return encode(OBS_MAGIC, {"obs": np.asarray(state, dtype=np.float32).tolist()}, images)


def decode_obs(body: bytes) -> tuple[object, dict[str, np.ndarray]]:
    """The state as sent (JSON: the service validates it as a state request's) and the frames."""
    framed = decode(OBS_MAGIC, body, "camera observation")
    if "obs" not in framed.header:
        raise WireError("obs", "the header has no state", "put the state's numbers in the header's \"obs\"")
    return framed.header["obs"], framed.frames


# -- an episode: its frame table and each camera's stream ---------------------------------------
def encode_episode(table_ipc: bytes, cameras: Mapping[str, np.ndarray]) -> bytes:
    """One finished episode: its table (Arrow IPC stream) and each camera's (T, H, W, 3) frames."""
    return encode(EPISODE_MAGIC, {}, cameras, payload=table_ipc)


def is_episode_body(data: bytes) -> bool:
    return data[: len(EPISODE_MAGIC)] == EPISODE_MAGIC


def decode_episode(body: bytes) -> tuple[bytes, dict[str, np.ndarray]]:
    """The table's bytes and each camera's frames."""
    framed = decode(EPISODE_MAGIC, body, "camera episode")
    return framed.payload, framed.frames
