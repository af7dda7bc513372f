#!/usr/bin/env python3
"""Modbus TCP peers for outpost's floor tests, on pymodbus (tests/floor/requirements.txt).

  peer.py plc --port P [--registers N] [--values V,V,...]
      A PLC: holding registers, input registers and coils 0..N-1 (wire
      addresses). Prints `ready` once listening, then one JSON line per
      write: {"table": "hr"|"co", "address": A, "values": [...]}. A write
      outside 0..N-1 is answered with exception 02 (illegal data address),
      as a PLC does. --values sets holding registers from 200 on (when N
      holds them) and input registers from 0.

  peer.py read --port P [--host H] [--source S] --fc F --address A --count C
      One read (fc 1, 2, 3 or 4) from outpost's server, from source address
      S (e.g. 127.0.0.2). Prints one JSON line: {"values": [...]} or
      {"exception": CODE} or {"error": "..."} (refused, closed).
"""

import argparse
import asyncio
import json
import sys

from pymodbus.client import ModbusTcpClient
from pymodbus.datastore import (
    ModbusSequentialDataBlock,
    ModbusServerContext,
    ModbusSlaveContext,
)
from pymodbus.server import ModbusTcpServer


def emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Watched(ModbusSequentialDataBlock):
    """A block that reports every write (the context adds 1 to wire addresses)."""

    def __init__(self, table, n):
        super().__init__(1, [0] * n)
        self.table = table

    def setValues(self, address, values):
        super().setValues(address, values)
        vals = values if isinstance(values, list) else [values]
        emit({"table": self.table, "address": address - 1, "values": [int(v) for v in vals]})


async def plc(args):
    n = args.registers
    hr = Watched("hr", n)
    co = Watched("co", n)
    ir = ModbusSequentialDataBlock(1, [0] * n)
    di = ModbusSequentialDataBlock(1, [0] * n)
    if args.values:
        vals = [int(v) for v in args.values.split(",")]
        if n >= 200 + len(vals):
            ModbusSequentialDataBlock.setValues(hr, 201, vals)
        ir.setValues(1, vals)
    ctx = ModbusServerContext(slaves={1: ModbusSlaveContext(hr=hr, co=co, ir=ir, di=di)}, single=False)
    server = ModbusTcpServer(ctx, address=(args.host, args.port))
    await server.serve_forever(background=True)
    emit("ready")
    await asyncio.Event().wait()


def read(args):
    c = ModbusTcpClient(
        args.host,
        port=args.port,
        source_address=(args.source, 0) if args.source else None,
        timeout=2,
        retries=0,
        reconnect_delay=0,
    )
    if not c.connect():
        emit({"error": "connect"})
        return
    try:
        call = {
            1: c.read_coils,
            2: c.read_discrete_inputs,
            3: c.read_holding_registers,
            4: c.read_input_registers,
        }[args.fc]
        r = call(args.address, count=args.count, slave=1)
    except Exception as e:  # the server closed the connection
        emit({"error": type(e).__name__})
        return
    finally:
        c.close()
    if r.isError():
        emit({"exception": getattr(r, "exception_code", -1)})
    elif args.fc <= 2:
        emit({"values": [int(b) for b in r.bits[: args.count]]})
    else:
        emit({"values": list(r.registers)})


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plc")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--registers", type=int, default=300)
    p.add_argument("--values", default="")
    r = sub.add_parser("read")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, required=True)
    r.add_argument("--source", default="")
    r.add_argument("--fc", type=int, required=True)
    r.add_argument("--address", type=int, required=True)
    r.add_argument("--count", type=int, required=True)
    args = ap.parse_args()
    if args.cmd == "plc":
        asyncio.run(plc(args))
    else:
        read(args)


if __name__ == "__main__":
    main()
