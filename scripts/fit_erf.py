#!/usr/bin/env python3
"""Fits the coefficients of erf on [0.875, 3.95] used by llvm/src/math.rs (ERF_MID).

A degree-13 least-squares fit on Chebyshev nodes of erf(2.4 + t), converted to monomials in t
and rounded to f32; prints the coefficients and their worst error in ulps, evaluated in f32
with Horner's rule. Needs numpy and mpmath (pip install numpy mpmath).
"""
import mpmath as mp
import numpy as np

mp.mp.dps = 30
LOW, HIGH, CENTER, DEGREE = 0.875, 3.95, 2.4, 13


def erf(x):
    return float(mp.erf(x))


nodes = np.cos(np.pi * (np.arange(3000) + 0.5) / 3000) * (HIGH - LOW) / 2 + (LOW + HIGH) / 2
fit = np.polynomial.chebyshev.Chebyshev.fit(nodes - CENTER, [erf(x) for x in nodes], DEGREE)
coefficients = np.float32(fit.convert(kind=np.polynomial.Polynomial).coef)

test = np.linspace(LOW, HIGH, 4001).astype(np.float32)
t = (test - np.float32(CENTER)).astype(np.float32)
value = np.float32(coefficients[-1])
for c in coefficients[-2::-1]:
    value = np.float32(value * t + c)
reference = np.array([erf(float(x)) for x in test])
worst = (np.abs(value.astype(np.float64) - reference) / np.spacing(np.float32(reference))).max()
print("coefficients:", [float(c) for c in coefficients])
print(f"worst error: {worst:.2f} ulps")
