"""Single-question benchmarks: conversion, checksums, storage, index and order scale, checkpoint stall, GPU check."""
