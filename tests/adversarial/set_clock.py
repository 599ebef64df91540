# Sets the clocks: clock_settime (to the time it reads, so that a success does no harm), settimeofday,
# adjtimex(ADJ_TICK) and clock_adjtime(ADJ_TICK) to the tick it reads (the knob that slews every
# process's monotonic clock, the trusted timer's too, by up to 10%).
import ctypes
import json

libc = ctypes.CDLL(None, use_errno=True)


class Timex(ctypes.Structure):
    _fields_ = [("modes", ctypes.c_uint), ("rest", ctypes.c_long * 25)]   # modes, then 200 bytes of fields


def tick_field(t):
    return t.rest[10]                     # struct timex on 64 bits: after modes, tick is the 11th long


seen = {}
ts = (ctypes.c_long * 2)()
libc.clock_gettime(0, ts)
seen["clock_settime"] = "set" if libc.clock_settime(0, ts) == 0 else ctypes.get_errno()
tv = (ctypes.c_long * 2)(ts[0], ts[1] // 1000)
seen["settimeofday"] = "set" if libc.settimeofday(tv, None) == 0 else ctypes.get_errno()
t = Timex()
read = libc.adjtimex(ctypes.byref(t))
seen["adjtimex_read"] = read if read >= 0 else ctypes.get_errno()
tick = tick_field(t) or 10000
t = Timex(modes=0x4000)                   # ADJ_TICK
t.rest[10] = tick
seen["adjtimex_tick"] = "set" if libc.adjtimex(ctypes.byref(t)) >= 0 else ctypes.get_errno()
seen["clock_adjtime_tick"] = "set" if libc.clock_adjtime(0, ctypes.byref(t)) >= 0 else ctypes.get_errno()
raise RuntimeError("REPORT " + json.dumps(seen))
