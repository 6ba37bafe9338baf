"""Sentinel values of the device cache's maps, shared by the kernels and the cache."""

ABSENT = 2**31 - 1  # host_to_device value of a token not on the device (int32 max)
FREE = -1  # device_to_host / priority value of a free slot
