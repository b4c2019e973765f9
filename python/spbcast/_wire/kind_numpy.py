"""The numpy kinds (no C++ counterpart: the core sees a tensor and bytes). numpy stays optional:
the root meets a numpy value only where the program imported numpy, and a follower imports it
only when the root sent one.

    (TAG_NUMPY_ARRAY, dtype, [shape], tensor)    an array: its bytes as a flat uint8 tensor
    (TAG_NUMPY_SCALAR, dtype, b"...")            a scalar: its bytes

dtypes sent: bool, integers, floats, complex, timedelta, datetime, bytes, str, raw void. Object
and structured dtypes hold Python objects or fields, which raw bytes do not rebuild.
"""

import re
import sys
import warnings

import torch

from .field_path import Refused, corrupt, import_optional
from .kind_traits import TAG_BYTES, TAG_NUMPY_ARRAY, TAG_NUMPY_SCALAR, Kind, check_bytes

_NUMPY_KINDS = "biufcmMSUV"
_NUMPY_DTYPE = re.compile(r"[<>|=][biufcmMSUV][0-9]{0,6}(\[[0-9]*[a-zA-Z]{1,3}\])?")


class _NumpyValue(Kind):
    """What an array and a scalar share: found by class, where numpy is imported (a numpy value
    means it is: spbcast never imports it on the root), of a plain numpy type and a dtype whose
    bytes rebuild it."""

    numpy_type, what = None, None

    def claims(self, cls, value):
        np = sys.modules.get("numpy")
        return np is not None and isinstance(value, getattr(np, self.numpy_type))

    def check(self, encoder, cls, value, path):
        np = sys.modules["numpy"]
        exact = cls is np.ndarray or (isinstance(value, np.generic) and cls is value.dtype.type)
        if not exact:
            encoder.fail(path, f"an instance of {cls.__module__}.{cls.__qualname__}, a subclass of a "
                               "numpy type; send np.asarray(a) (or a plain numpy scalar)")
        dt = value.dtype
        if dt.kind not in _NUMPY_KINDS or dt.hasobject or dt.fields is not None \
                or dt.subdtype is not None or not _NUMPY_DTYPE.fullmatch(dt.str):
            encoder.fail(path, f"a numpy {self.what} of dtype {dt}; spbcast sends numpy values of "
                               "bool, integer, float, complex, datetime, timedelta, bytes and str "
                               "dtypes (send each field of a structured array as its own array; "
                               "convert object arrays)")
        return self


def _dtype(np, text):
    dt = None
    if type(text) is str and _NUMPY_DTYPE.fullmatch(text):
        try:
            dt = np.dtype(text)
        except (TypeError, ValueError):  # "<i3", "<M8[abc]": the pattern, not a dtype
            pass
    # A zero-sized element ("|S0") is one byte an element in numpy: bytes nobody sent.
    if (dt is None or dt.kind not in _NUMPY_KINDS or dt.hasobject or dt.fields is not None
            or dt.subdtype is not None or dt.itemsize == 0):
        raise corrupt(f"a numpy dtype {text!r}")
    return dt


class NumpyArray(_NumpyValue):
    """An array's bytes as a view on both sides, not a copy; an array met twice on the root is
    sent as one tensor, and rebuilt as one array."""

    numpy_type, what = "ndarray", "array"
    decodes = (TAG_NUMPY_ARRAY,)

    def encode(self, encoder, value, path, depth):
        seen = encoder.arrays.get(id(value))
        if seen is None:
            np = sys.modules["numpy"]
            flat = np.ascontiguousarray(value).reshape(-1)
            if flat.nbytes == 0:
                tensor = torch.empty(0, dtype=torch.uint8)
            else:
                with warnings.catch_warnings():  # a read-only array: the root only reads it
                    warnings.simplefilter("ignore", UserWarning)
                    tensor = torch.from_numpy(flat.view(np.uint8))
            seen = encoder.arrays[id(value)] = (value, tensor)  # holds value: its id stays its own
        return (TAG_NUMPY_ARRAY, value.dtype.str, [int(d) for d in value.shape], seen[1])

    def decode(self, decoder, value, depth):
        if not (len(value) == 4 and type(value[2]) is list and type(value[3]) is torch.Tensor
                and len(value[2]) <= 64 and all(type(d) is int and d >= 0 for d in value[2])):
            raise corrupt("a malformed numpy array")
        np = import_optional("numpy")
        dt = _dtype(np, value[1])
        tensor, shape = value[3], value[2]
        key = (id(tensor), dt.str, tuple(shape))
        array = decoder.arrays.get(key)
        if array is not None:
            return array
        count = 1
        for d in shape:
            count *= d
        if (tensor.layout != torch.strided or tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous()
                or tensor.numel() != count * dt.itemsize):
            raise corrupt("a numpy array whose bytes do not match its dtype and shape")
        if tensor.numel() == 0:
            # Empty: the other dimensions still multiply into numpy's size, which must fit.
            cells = dt.itemsize
            for d in shape:
                cells *= max(d, 1)
            if cells >= 1 << 62 or len(shape) > 64:
                raise corrupt("an empty numpy array whose shape numpy cannot hold")
            array = np.zeros(shape, dt)
        else:
            # A view of the received bytes (which the array keeps alive), not a copy.
            array = tensor.numpy().view(dt).reshape(shape)
        decoder.arrays[key] = array  # the tree holds the tensor: its id stays its own
        return array


class NumpyScalar(_NumpyValue):
    numpy_type, what = "generic", "scalar"
    decodes = (TAG_NUMPY_SCALAR,)

    def encode(self, encoder, value, path, depth):
        data = value.tobytes()
        check_bytes(encoder, data, path)
        return (TAG_NUMPY_SCALAR, value.dtype.str, (TAG_BYTES, data))

    def decode(self, decoder, value, depth):
        if len(value) != 3 or type(value[2]) is not bytes:
            raise corrupt("a malformed numpy scalar")
        np = import_optional("numpy")
        dt = _dtype(np, value[1])
        data = value[2]
        if len(data) != dt.itemsize or dt.itemsize == 0:
            raise corrupt("a numpy scalar whose bytes do not match its dtype")
        # An element read from an array drops a str's or bytes' trailing NULs (and with them
        # the scalar's dtype size): build those from their bytes instead.
        if dt.kind == "S":
            return np.bytes_(data)
        if dt.kind == "U":
            try:
                return np.str_(data.decode("utf-32-be" if dt.str[0] == ">" else "utf-32-le"))
            except UnicodeDecodeError:
                raise corrupt("a numpy str scalar that is not UTF-32") from None
        return np.frombuffer(data, dt)[0]
