"""`ds4station plan`: propose a route, a context length and expert caches for these GPUs (or hypothetical
ones), and print per-stage predicted memory against what each device has."""

from __future__ import annotations

import argparse
import json
import sys

from ds4station.model.sizes import token_count


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="PATH", help="a DS4 GGUF file (its tensor table gives the weights)")
    src.add_argument("--shape", metavar="NAME", help="a named shape instead of a file: flash-q2 (default), "
                     "flash-q2-q4, flash-q4, demo-q2 (the built-in demo model), tiny-q2, flash-f16, tiny-f16")
    p.add_argument("--gpus", default="auto", metavar="auto|SPEC|PROFILE",
                   help="auto (detected GPUs), a SPEC of cards in stage order such as 32GiB,16GiB:desktop,16GiBx4 "
                        "(flags :desktop, :apu, :bw=GBPS; cpu[:SIZE][:bw=GBPS] adds a CPU stage), or a host profile "
                        "name from presets/")
    p.add_argument("--host-ram", metavar="SIZE", help="system RAM (for CPU stages and APU GTT); auto: this machine's")
    p.add_argument("--preset", default="speed", metavar="speed|context|PATH", help="planner preset (default speed)")
    p.add_argument("--ctx", metavar="N", type=token_count, help="context length in tokens (e.g. 32768, 32K, 1M)")
    p.add_argument("--expert-cache", metavar="SIZE",
                   help="stream routed experts through a cache of SIZE per GPU process (0 = keep them resident)")
    p.add_argument("--sessions", type=int, metavar="N", help="live KV sessions to plan for (default: the preset's)")
    p.add_argument("--prefill-chunk", type=token_count, metavar="N", help="tokens per prefill step (default: the "
                   "preset's)")
    p.add_argument("--rollback", type=token_count, metavar="N", help="positions a session can roll back (default: "
                   "the preset's)")
    p.add_argument("--draft", choices=("off", "lookup", "mtp"), default="off",
                   help="the speculative decoding serve will run (serve --draft): 'mtp' counts the MTP layer beside "
                        "the output head (its weights and every session's state); written to the launch file")
    p.add_argument("--mtp", metavar="FILE", help="the MTP layer's own GGUF for --draft mtp (default: the model "
                   "file's own; a named shape has one)")
    p.add_argument("--out", metavar="FILE", help="also write the plan as a launch file for `ds4station serve --plan "
                   "FILE`")
    p.add_argument("--desktop-headroom", metavar="SIZE", help="memory left free on the card driving the display")
    p.add_argument("--sysfs-root", default="/", metavar="PATH", help="AMD sysfs root for --gpus auto")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from ds4station.model.footprint import DEMO_SHAPE, named_shape, shape_from_specs
    from ds4station.model.sizes import parse_size
    from ds4station.planner.devices import budgets_from_gpus, parse_gpu_spec
    from ds4station.planner.presets import PresetError, is_host_profile, load_host_profile, load_preset
    from ds4station.planner.propose import PlanError, propose

    try:
        settings = load_preset(args.preset)
        if args.desktop_headroom is not None:
            settings = dataclasses.replace(settings, desktop_headroom=parse_size(args.desktop_headroom))
        given = {k: v for k, v in (("sessions", args.sessions), ("prefill_chunk", args.prefill_chunk),
                                   ("rollback", args.rollback)) if v is not None}
        if given:
            settings = dataclasses.replace(settings, footprint=dataclasses.replace(settings.footprint, **given))
        host_ram = parse_size(args.host_ram) if args.host_ram else None
        cache = parse_size(args.expert_cache) if args.expert_cache is not None else None
        if args.model:
            from ds4station.model.gguf import GGUFError, GGUFFile

            try:
                f = GGUFFile.open(args.model)
            except GGUFError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            layer = f.mtp_specs() if f.has_mtp else []
            if args.mtp:
                try:
                    layer = GGUFFile.open_mtp(args.mtp, f.config).mtp_specs()
                except GGUFError as e:
                    print(f"error: {e}", file=sys.stderr)
                    return 2
            model = shape_from_specs(f.path.name, f.config, f.tensor_specs(), layer)
        else:
            if args.mtp:
                print("error: --mtp FILE goes with --model FILE (a named shape has its MTP layer)", file=sys.stderr)
                return 2
            model = named_shape(args.shape or "flash-q2")
        if args.mtp and args.draft != "mtp":
            print("error: --mtp FILE is the MTP layer for --draft mtp; add --draft mtp (or drop --mtp)",
                  file=sys.stderr)
            return 2
        if args.draft == "mtp":
            settings = dataclasses.replace(settings, footprint=dataclasses.replace(settings.footprint, mtp=True))
            if not model.mtp_specs:
                print(f"error: {model.name} has no MTP layer (no mtp.0.* tensors): give the layer's own GGUF with "
                      "--mtp FILE (`ds4station pull mtp`), or plan without --draft mtp", file=sys.stderr)
                return 2
        if args.gpus == "auto":
            from ds4station.hardware import detect

            gpus = detect(args.sysfs_root)
            if not gpus:
                print("error: no GPU found; plan for hypothetical cards with --gpus SPEC "
                      "(e.g. 32GiB,16GiB:desktop,16GiBx4) or a host profile (e.g. gfx906-workstation)",
                      file=sys.stderr)
                return 1
            if host_ram is None:
                import psutil

                host_ram = int(psutil.virtual_memory().total)
            budgets = budgets_from_gpus(gpus, host_ram)
            # Discrete cards first, roomiest first: the first holds the embedding, the output head and the most
            # layers; an APU's shared memory is slower, so it takes what the discrete cards cannot.
            budgets.sort(key=lambda b: (b.kind != "gpu", -b.available(settings.desktop_headroom, settings.reserve)))
        elif is_host_profile(args.gpus):
            profile = load_host_profile(args.gpus)
            host_ram = host_ram if host_ram is not None else profile.host_ram
            budgets = parse_gpu_spec(profile.gpus, host_ram)
        else:
            budgets = parse_gpu_spec(args.gpus, host_ram)
    except (ValueError, PresetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        plan = propose(model, budgets, settings, ctx=args.ctx or None, expert_cache=cache, host_ram=host_ram)
    except PlanError as e:
        if args.json:
            print(json.dumps({"error": str(e), "preset": settings.name, "model": model.name}))
        else:
            print(f"error: {e}", file=sys.stderr)
        return 1
    if args.out:
        from ds4station.planner.launch import launch_from_plan, write_launch

        demo = not args.model and (args.shape or "flash-q2") == DEMO_SHAPE  # the built-in demo model
        write_launch(args.out, launch_from_plan(plan, str(args.model) if args.model else "" if demo else None,
                                                draft=args.draft, mtp=args.mtp), plan)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
        return 0
    _print(plan, model.total_bytes)
    if args.out:
        print(f"\nwrote {args.out}: run it with `ds4station serve --plan {args.out}`")
    return 0


def _print(plan, model_bytes: int) -> None:  # type: ignore[no-untyped-def]
    g = 2**30
    mode = "experts streamed" if plan.streaming else "resident"
    print(f"plan: preset {plan.preset}, model {plan.model} ({model_bytes / g:.2f} GiB), {mode}, "
          f"context {plan.ctx} tokens")
    fs = plan.footprint
    print(f"route: {plan.route}")
    print(f"sessions {fs.sessions}, prefill chunk {fs.prefill_chunk}, rollback {fs.rollback}, KV {fs.kv_dtype}")
    print(f"\n{'stage':>5}  {'device':14} {'layers':>16} {'weights':>8} {'KV':>7} {'scratch':>8} {'runtime':>8} "
          f"{'cache':>7} {'predicted':>10} {'available':>10} {'spare':>7}  GiB")
    for i, s in enumerate(plan.stages):
        st, f = s.stage, s.footprint
        span = ("embed," if st.embed else "") + f"{st.first_layer}-{st.last_layer}" + (",output" if st.output else "")
        print(f"{i:>5}  {st.device:14} {span:>16} {f.weights_bytes / g:8.2f} {f.kv_bytes / g:7.2f} "
              f"{f.scratch_bytes / g:8.2f} {f.overhead_bytes / g:8.2f} {f.expert_cache_bytes / g:7.2f} "
              f"{f.predicted_bytes / g:10.2f} {s.available_bytes / g:10.2f} {s.spare_bytes / g:7.2f}  "
              f"{s.budget.describe()}" + (f", >= {s.decode_ms:.1f} ms/token" if s.decode_ms else ""))
    for i, s in enumerate(plan.stages):
        if s.footprint.mtp_bytes:
            print(f"the MTP layer (--draft mtp) is on stage {i}: {s.footprint.mtp_bytes / g:.2f} GiB of its "
                  "predicted bytes (its weights and every session's state)")
    for note in plan.notes:
        print(f"note: {note}")
