"""habana_stub: device-type query (vllm_gaudi.extension.{ops,scales,environment} ask at import)."""
import enum


class synDeviceType(enum.IntEnum):  # noqa: N801  (name of the real enum)
    synDeviceGaudi2 = 2
    synDeviceGaudi3 = 3
    synDeviceStub = 0


def _get_device_type() -> synDeviceType:
    """No Gaudi here: a device type that is neither Gaudi 2 nor Gaudi 3."""
    return synDeviceType.synDeviceStub
