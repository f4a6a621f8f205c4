"""rl.runtime.host.cpu_name: the CPU named in results, read from /proc/cpuinfo text."""
from rl.runtime.host import cpu_name

# two processors of a VM that names no model number (as this project's CI machine does)
EPYC_VM = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
cpu MHz\t\t: 2596.124

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13
"""

XEON = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 85
model name\t: Intel(R) Xeon(R) CPU @ 2.20GHz
"""


def test_names_the_first_processor_with_family_and_model():
    assert cpu_name(EPYC_VM) == "AMD EPYC (family 26 model 2)"
    assert cpu_name(XEON) == "Intel(R) Xeon(R) CPU @ 2.20GHz (family 6 model 85)"


def test_without_family_the_model_name_alone():
    assert cpu_name("processor\t: 0\nmodel name\t: Neoverse-N1\n") == "Neoverse-N1"


def test_no_processor_named():
    assert cpu_name("") is None
    assert cpu_name("processor\t: 0\nBogoMIPS\t: 50.00\n") is None
