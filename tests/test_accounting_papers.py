"""The published figures the accountant must reproduce (paper 002 Tables 1-2 and text, paper 000).

Conventions established here (see coordinator/mechanisms/tree_sensitivity.py and accounting.py):
- MinS counts rounds strictly between two participations; en-IN tells the conventions apart.
- Paper 002 converts zCDP to eps with PLD, starting from the zCDP *rounded to 2 decimals*.
- Paper 000's eps come from RDP (single participation, T = 1600, delta = 1e-6).
"""

import pytest

from dpfleet.coordinator.accounting.zcdp import epsilon_from_zcdp, zcdp_from_noise
from dpfleet.coordinator.mechanisms.tree_sensitivity import tree_sensitivity_squared

Z = 7.0  # every model of paper 002 Tables 1-2: noise multiplier 7, report goal 6500

# paper 002 Table 1 (NWP): name, rounds, MinS, MaxP, published zCDP, our exact S
TABLE1 = [
    ("de-DE", 930, 212, 4, 0.48, 47),
    ("en-GB", 980, 226, 4, 0.48, 47),
    ("fr-FR", 1280, 180, 5, 0.89, 87),
    ("it-IT", 1620, 303, 5, 0.71, 70),
    ("pt-PT", 530, 54, 8, 1.86, 182),
    ("es-ES", 1900, 526, 3, 0.35, 34),
    ("es-ES*", 1750, 349, 4, 0.52, 51),
    ("en-US", 2800, 371, 7, 1.31, 128),
    ("en-US*", 1360, 622, 2, 0.25, 24),
    ("pt-BR", 3600, 909, 3, 0.45, 44),
    ("en-IN", 1290, 170, 6, 1.14, 112),
    ("es-MX", 1980, 343, 5, 0.64, 63),
    ("es-AR", 640, 90, 5, 0.84, 82),
]

# paper 002 Table 2 (OTF): name, rounds, MinS, MaxP, zCDP, eps(1e-10), our S, our eps from exact rho
TABLE2 = [
    ("de-DE", 1170, 206, 5, 0.89, 9.01, 87, 9.00),
    ("en-GB", 1220, 206, 5, 0.89, 9.01, 87, 9.00),
    ("es-ES", 1280, 197, 5, 0.89, 9.01, 87, 9.00),
    ("fr-FR", 1300, 290, 4, 0.61, 7.31, 60, 7.32),
    ("it-IT", 1360, 188, 5, 0.89, 9.01, 87, 9.00),
    ("ru-RU", 870, 327, 3, 0.32, 5.13, 31, 5.10),
    ("pt-PT", 430, 54, 7, 0.99, 9.56, 97, 9.56),
]


@pytest.mark.parametrize("name,rounds,mins,maxp,published,s", TABLE1)
def test_table1_zcdp(name, rounds, mins, maxp, published, s):
    assert tree_sensitivity_squared(rounds, maxp, mins) == s
    rho = zcdp_from_noise(Z, rounds, maxp, mins)
    assert rho == pytest.approx(s / (2 * Z**2))
    if name == "en-US*":
        # Not reproducible: with z = 7, rho = S / 98 and 0.25 would need S = 24.5. The exact
        # worst case is S = 24 under either MinS convention, rho = 0.2449 (prints 0.24). The
        # published 0.25 is consistent with rounding up or with the SecAgg run's slightly
        # inflated sensitivity (paper 002 Sec. 2.4); we report the exact value.
        assert round(rho, 4) == 0.2449 and abs(rho - published) < 0.01
    else:
        assert round(rho, 2) == published


def test_table1_fixes_the_min_separation_convention():
    # en-IN: MinS read as "y - x >= 170" (i.e. 169 rounds between) gives 1.18, not 1.14
    assert round(zcdp_from_noise(Z, 1290, 6, 169), 2) == 1.18
    assert round(zcdp_from_noise(Z, 1290, 6, 170), 2) == 1.14


@pytest.mark.parametrize("name,rounds,mins,maxp,published,eps,s,eps_exact", TABLE2)
def test_table2_zcdp_and_epsilon(name, rounds, mins, maxp, published, eps, s, eps_exact):
    assert tree_sensitivity_squared(rounds, maxp, mins) == s
    rho = zcdp_from_noise(Z, rounds, maxp, mins)
    assert round(rho, 2) == published
    # the published eps is PLD applied to the rounded zCDP ...
    assert round(epsilon_from_zcdp(round(rho, 2), 1e-10, "pld"), 2) == eps
    # ... the exact rho gives slightly different values for 4 of the 7 rows
    assert round(epsilon_from_zcdp(rho, 1e-10, "pld"), 2) == eps_exact


@pytest.mark.parametrize("rho,eps", [(0.25, 4.49), (1.86, 13.69)])
def test_paper002_text_conversions_use_pld(rho, eps):
    assert round(epsilon_from_zcdp(rho, 1e-10, "pld"), 2) == eps
    # RDP would have said 4.70 / 14.26: the text's figures are PLD
    assert epsilon_from_zcdp(rho, 1e-10, "rdp") > eps + 0.2


def test_paper002_text_extremes_from_exact_rho():
    # the text's extremes are en-US* (S = 24) and pt-PT NWP (S = 182) of Table 1
    assert round(epsilon_from_zcdp(24 / 98, 1e-10), 2) == 4.44
    assert round(epsilon_from_zcdp(182 / 98, 1e-10), 2) == 13.68


@pytest.mark.parametrize("z,eps", [(8.83, 1.77), (1.13, 18.71)])
def test_paper000_single_participation(z, eps):
    # T = 1600, each client at most once: S = depth of the 1024-round tree = 11
    rho = zcdp_from_noise(z, 1600, max_participation=1)
    assert rho == pytest.approx(11 / (2 * z * z))
    assert round(epsilon_from_zcdp(rho, 1e-6, "rdp"), 2) == eps
    # the same guarantee converted with PLD is tighter (1.65 / 17.67)
    assert epsilon_from_zcdp(rho, 1e-6, "pld") < eps - 0.1
