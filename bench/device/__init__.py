"""The GPU machine's checks (`bash bench/device/check.sh`): ffmem index on random-weight models of real
shapes (run_index), and what that machine needs installed beside its torch (wheelhouse)."""
