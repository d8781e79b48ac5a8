//! `cargo xtask bench`: the layer benchmark (`benches/layer.rs`) across shapes, token counts and
//! backends, with the PyTorch layer measured in the same run when python3 has torch with CUDA,
//! progress while it runs, and `results.json` plus `chart.svg` (TFLOP/s per case for each backend
//! and PyTorch, with the FLOP and byte floors marked) in the output folder.
//!
//! Launched by torchrun or srun with more than one rank, every process runs the layer bench,
//! which then runs the layer across the processes, one rank per GPU; rank 0 reports (no PyTorch
//! comparison there: the PyTorch layer runs on one GPU). That path is built and not yet run (no
//! multi-GPU machine has been lent). `--ranks P` instead measures P virtual ranks inside one
//! process. xtask keeps to anyhow and clap, so it reads the launcher's variables itself, the same
//! ones `mok_host::symmetric::LaunchEnv` reads.

use std::fmt::Write as _;
use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::describe;

/// What to measure (the command's options).
#[derive(Clone, Debug)]
pub struct BenchArgs {
    pub shapes: Vec<String>,
    pub tokens: Vec<usize>,
    pub backends: Vec<String>,
    pub ranks: usize,
    /// With virtual ranks: each rank's ring as this many times an even split's rows.
    pub ring_factor: Option<f64>,
    pub reps: usize,
    pub out: PathBuf,
    pub torch: bool,
    /// A layer-bench binary already built (the GPU bundle's `benches/layer`): no cargo build, and
    /// the Python scripts are looked for next to it.
    pub layer_bin: Option<PathBuf>,
}

/// The frontier shapes the layer bench knows.
const SHAPES: [&str; 4] = ["kimi", "glm", "qwen", "deepseek"];
/// The backends the layer bench knows (`megakernel:N`, `megakernels:N` and `megakernels:F/B` too; `megakernels`:
/// the forward and the backward megakernels, on one GPU, over virtual ranks or across processes,
/// where `megakernel` runs both too). All but `mma` also take a `-gathering` suffix: the token
/// rows gathered in the gate/up's and the weight gradients' producers, or `-gathering-forward`:
/// in the gate/up's alone (one GPU only).
const BACKENDS: [&str; 4] = ["mma", "engine", "megakernel", "megakernels"];

/// The suffixes of a backend whose GEMM producers gather the token rows.
const GATHERING: [&str; 2] = ["-gathering", "-gathering-forward"];

/// `backend` without its gathering suffix, and whether it had one.
fn without_gathering(backend: &str) -> (&str, bool) {
    GATHERING.iter().find_map(|suffix| backend.strip_suffix(suffix)).map_or((backend, false), |name| (name, true))
}

impl BenchArgs {
    /// Checks the options and returns the bench's `--cases` value.
    pub fn cases(&self) -> Result<String> {
        if self.shapes.is_empty() || self.tokens.is_empty() || self.backends.is_empty() {
            bail!("--shapes, --tokens and --backends each need at least one value");
        }
        for shape in &self.shapes {
            if !SHAPES.contains(&shape.as_str()) {
                bail!("--shapes: unknown shape {shape:?} (known: {})", SHAPES.join(", "));
            }
        }
        for backend in &self.backends {
            let (name, gathering) = without_gathering(backend);
            let base = name.split(':').next().unwrap_or_default();
            let count_ok = match name.split_once(':') {
                None => true,
                Some(("megakernel", n)) => n.parse::<u32>().is_ok(),
                // `F/B`: the forward's and the backward's comm blocks apart.
                Some(("megakernels", n)) => n.split('/').count() <= 2 && n.split('/').all(|n| n.parse::<u32>().is_ok()),
                Some(_) => false,
            };
            if !BACKENDS.contains(&base) || !count_ok || (gathering && base == "mma") {
                bail!(
                    "--backends: unknown backend {backend:?} (known: mma, engine, megakernel[:N], megakernels[:N or :F/B]; \
                     the last three also with -gathering or -gathering-forward)"
                );
            }
        }
        if self.ranks == 0 || self.reps == 0 {
            bail!("--ranks and --reps must be at least 1");
        }
        if let Some(factor) = self.ring_factor {
            if self.ranks == 1 {
                bail!("--ring-factor sizes the rings of virtual ranks: give --ranks P too");
            }
            if !(factor >= 1.0 && factor.is_finite()) {
                bail!("--ring-factor {factor}: a ring must hold at least an even split (1 or more)");
            }
        }
        for &t in &self.tokens {
            if t == 0 || !t.is_multiple_of(self.ranks) {
                bail!("--tokens {t}: must be positive and split evenly over --ranks {}", self.ranks);
            }
        }
        Ok(self
            .shapes
            .iter()
            .flat_map(|s| self.tokens.iter().map(move |t| format!("{s}:{t}")))
            .collect::<Vec<_>>()
            .join(","))
    }

    /// Runs the layer bench this many times (cases × backends).
    pub fn runs(&self) -> usize {
        self.shapes.len() * self.tokens.len() * self.backends.len()
    }
}

/// (rank, world) from torchrun's (`RANK`, `WORLD_SIZE`) or an `srun` step's (`SLURM_PROCID`,
/// `SLURM_STEP_NUM_TASKS` or else `SLURM_NTASKS`) variables, read through `get`, as the layer's
/// `LaunchEnv` reads them; (0, 1) when neither launcher set them, and in an `sbatch` script's
/// batch step or an `salloc` shell (Slurm's variables without `SLURM_STEP_ID`).
pub fn launch_world(get: impl Fn(&str) -> Option<String>) -> Result<(usize, usize)> {
    let pair = if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
        ("RANK", "WORLD_SIZE")
    } else if get("SLURM_STEP_ID").is_some() || get("SLURM_STEPID").is_some() {
        ("SLURM_PROCID", if get("SLURM_STEP_NUM_TASKS").is_some() { "SLURM_STEP_NUM_TASKS" } else { "SLURM_NTASKS" })
    } else {
        return Ok((0, 1));
    };
    let number = |name: &str| -> Result<usize> {
        let text = get(name).with_context(|| {
            format!("{name} is unset while {} is set", if name == pair.0 { pair.1 } else { pair.0 })
        })?;
        text.trim().parse().with_context(|| format!("{name}={text:?} is not a non-negative integer"))
    };
    let (rank, world) = (number(pair.0)?, number(pair.1)?);
    if world == 0 || rank >= world {
        bail!("{}={rank} {}={world}: the rank must be below a positive world size", pair.0, pair.1);
    }
    Ok((rank, world))
}

/// One `RESULT` line of the layer bench.
#[derive(Clone, Debug, PartialEq)]
pub struct Measurement {
    pub shape: String,
    pub tokens: usize,
    pub backend: String,
    /// name → value (NaN where the bench had none, e.g. no PyTorch baseline).
    pub values: Vec<(String, f64)>,
}

impl Measurement {
    pub fn get(&self, name: &str) -> f64 {
        self.values.iter().find(|(n, _)| n == name).map_or(f64::NAN, |(_, v)| *v)
    }
}

/// Parses `RESULT shape tokens backend name value name value ...`; `None` for any other line.
pub fn parse_result(line: &str) -> Option<Measurement> {
    let mut words = line.split_whitespace();
    if words.next()? != "RESULT" {
        return None;
    }
    let (shape, tokens, backend) = (words.next()?.to_string(), words.next()?.parse().ok()?, words.next()?.to_string());
    let rest: Vec<&str> = words.collect();
    let values =
        rest.chunks(2).filter(|p| p.len() == 2).map(|p| (p[0].to_string(), p[1].parse().unwrap_or(f64::NAN))).collect();
    Some(Measurement { shape, tokens, backend, values })
}

fn json_number(v: f64) -> String {
    if v.is_finite() { format!("{v}") } else { "null".into() }
}

fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The results as JSON: the ceilings the floors used, then one object per measurement.
pub fn to_json(ceilings: Option<(f64, f64)>, results: &[Measurement]) -> String {
    let mut out = String::from("{\n");
    match ceilings {
        Some((matmul, copy)) => {
            let _ = writeln!(
                out,
                "  \"ceilings\": {{\"matmul_tflops\": {}, \"copy_tbps\": {}}},",
                json_number(matmul),
                json_number(copy)
            );
        }
        None => out.push_str("  \"ceilings\": null,\n"),
    }
    out.push_str("  \"results\": [");
    for (n, m) in results.iter().enumerate() {
        out.push_str(if n == 0 { "\n    {" } else { ",\n    {" });
        let _ = write!(
            out,
            "\"shape\": {}, \"tokens\": {}, \"backend\": {}",
            json_string(&m.shape),
            m.tokens,
            json_string(&m.backend)
        );
        for (name, value) in &m.values {
            let _ = write!(out, ", {}: {}", json_string(name), json_number(*value));
        }
        out.push('}');
    }
    out.push_str("\n  ]\n}\n");
    out
}

/// The chart: two panels (forward; forward + backward) of grouped bars, TFLOP/s per case for
/// each backend and PyTorch (where measured), the FLOP floor (the matmul ceiling) and the byte
/// floor of each case as dashed marks across its group.
pub fn to_svg(results: &[Measurement]) -> String {
    let mut cases: Vec<(String, usize)> = Vec::new();
    let mut series: Vec<String> = Vec::new();
    for m in results {
        if !cases.contains(&(m.shape.clone(), m.tokens)) {
            cases.push((m.shape.clone(), m.tokens));
        }
        if !series.contains(&m.backend) {
            series.push(m.backend.clone());
        }
    }
    // PyTorch and the floors are drawn and named only where measured (across processes neither
    // is).
    let measured = |name: &str| results.iter().any(|m| m.get(name).is_finite());
    let with_torch = measured("torch_fwd_ms") || measured("torch_step_ms");
    let with_floors = ["fwd_flop_floor_ms", "fwd_byte_floor_ms", "step_floor_ms"].into_iter().any(measured);
    if with_torch {
        series.push("PyTorch".into());
    }
    let is_torch = |s: usize| with_torch && s + 1 == series.len();
    let colours = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f"];
    let colour = |i: usize| if is_torch(i) { "#7f7f7f" } else { colours[i % colours.len()] };
    // value(case, series, panel) in TFLOP/s; floors(case, panel) = (flop floor, byte floor) TFLOP/s.
    let find = |case: &(String, usize), backend: &str| {
        results.iter().find(|m| m.shape == case.0 && m.tokens == case.1 && m.backend == backend)
    };
    let any = |case: &(String, usize)| results.iter().find(|m| m.shape == case.0 && m.tokens == case.1);
    let tflops = |flops: f64, ms: f64| if ms > 0.0 { flops / ms / 1e9 } else { f64::NAN };
    let value = |case: &(String, usize), s: usize, panel: usize| -> f64 {
        let work = |m: &Measurement| m.get("flops") * if panel == 0 { 1.0 } else { 3.0 };
        if is_torch(s) {
            any(case)
                .map_or(f64::NAN, |m| tflops(work(m), m.get(if panel == 0 { "torch_fwd_ms" } else { "torch_step_ms" })))
        } else {
            find(case, &series[s])
                .map_or(f64::NAN, |m| tflops(work(m), m.get(if panel == 0 { "fwd_ms" } else { "step_ms" })))
        }
    };
    let floors = |case: &(String, usize), panel: usize| -> (f64, f64) {
        any(case).map_or((f64::NAN, f64::NAN), |m| {
            let work = m.get("flops") * if panel == 0 { 1.0 } else { 3.0 };
            if panel == 0 {
                (tflops(work, m.get("fwd_flop_floor_ms")), tflops(work, m.get("fwd_byte_floor_ms")))
            } else {
                // The forward + backward floor is already the larger of its two times.
                (tflops(work, m.get("step_floor_ms")), f64::NAN)
            }
        })
    };
    let mut top = 1.0f64;
    for case in &cases {
        for panel in 0..2 {
            for s in 0..series.len() {
                let v = value(case, s, panel);
                if v.is_finite() {
                    top = top.max(v)
                }
            }
            // The binding floor (the lower rate) sets the scale; the other is marked only when
            // it fits.
            let (a, b) = floors(case, panel);
            let binding = if a.is_finite() && b.is_finite() {
                a.min(b)
            } else if a.is_finite() {
                a
            } else {
                b
            };
            if binding.is_finite() {
                top = top.max(binding)
            }
        }
    }
    let top = (top * 1.05 / 100.0).ceil() * 100.0;
    let (panel_w, panel_h, left, margin_top, bottom) = (520.0, 300.0, 60.0, 50.0, 70.0);
    let width = left + 2.0 * (panel_w + 30.0) + 10.0;
    // The legend: the series four to a row, then the floors' key on a row of its own (it is
    // as wide as three series).
    let legend_rows = series.len().div_ceil(4) + usize::from(with_floors);
    let height = margin_top + panel_h + bottom + 22.0 * legend_rows as f64 + 20.0;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    for panel in 0..2 {
        let x0 = left + panel as f64 * (panel_w + 30.0);
        let title = if panel == 0 { "forward" } else { "forward + backward" };
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="20" font-size="15" font-weight="bold">{title}, TFLOP/s (MoK's FLOP count)</text>"#,
            x0
        );
        let y = |v: f64| margin_top + panel_h * (1.0 - v / top);
        for tick in 0..=5 {
            let v = top * tick as f64 / 5.0;
            let _ = writeln!(
                svg,
                r##"<line x1="{x0}" x2="{}" y1="{:.1}" y2="{:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{v:.0}</text>"##,
                x0 + panel_w,
                y(v),
                y(v),
                x0 - 4.0,
                y(v) + 4.0
            );
        }
        let group_w = panel_w / cases.len().max(1) as f64;
        let bar_w = group_w * 0.8 / series.len() as f64;
        for (c, case) in cases.iter().enumerate() {
            let gx = x0 + c as f64 * group_w + group_w * 0.1;
            for (s, name) in series.iter().enumerate() {
                let v = value(case, s, panel);
                if v.is_finite() {
                    let _ = writeln!(
                        svg,
                        r#"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{} {}: {v:.0} TFLOP/s</title></rect>"#,
                        gx + s as f64 * bar_w,
                        y(v),
                        bar_w * 0.92,
                        panel_h - (y(v) - margin_top),
                        colour(s),
                        case.0,
                        name
                    );
                }
            }
            let (flop, bytes) = floors(case, panel);
            let first = if panel == 0 { "FLOP floor" } else { "floor (FLOP or bytes, the larger time)" };
            for (v, dash, name) in [(flop, "6,3", first), (bytes, "2,2", "byte floor")] {
                if v.is_finite() && v <= top {
                    let _ = writeln!(
                        svg,
                        r#"<line x1="{:.1}" x2="{:.1}" y1="{:.1}" y2="{:.1}" stroke="black" stroke-width="1.5" stroke-dasharray="{dash}"><title>{name}: {v:.0} TFLOP/s</title></line>"#,
                        gx - 2.0,
                        gx + group_w * 0.8 + 2.0,
                        y(v),
                        y(v)
                    );
                }
            }
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text><text x="{:.1}" y="{:.1}" text-anchor="middle">T={}</text>"#,
                gx + group_w * 0.4,
                margin_top + panel_h + 16.0,
                case.0,
                gx + group_w * 0.4,
                margin_top + panel_h + 30.0,
                case.1
            );
        }
        let _ = writeln!(
            svg,
            r#"<line x1="{x0}" x2="{}" y1="{:.1}" y2="{:.1}" stroke="black"/>"#,
            x0 + panel_w,
            y(0.0),
            y(0.0)
        );
    }
    let legend_y = margin_top + panel_h + 50.0;
    let mut items: Vec<(String, String)> =
        series.iter().enumerate().map(|(i, s)| (s.clone(), colour(i).to_string())).collect();
    if with_floors {
        items.push(("floors: FLOP (dashed), bytes (dotted); forward + backward: the larger".into(), "none".into()));
    }
    for (n, (name, fill)) in items.iter().enumerate() {
        let (lx, ly) = if n < series.len() {
            (left + (n % 4) as f64 * 260.0, legend_y + (n / 4) as f64 * 22.0)
        } else {
            (left, legend_y + (legend_rows - 1) as f64 * 22.0)
        };
        if fill == "none" {
            let _ = writeln!(
                svg,
                r#"<line x1="{lx}" x2="{}" y1="{}" y2="{}" stroke="black" stroke-dasharray="6,3"/>"#,
                lx + 14.0,
                ly + 6.0,
                ly + 6.0
            );
        } else {
            let _ = writeln!(svg, r#"<rect x="{lx}" y="{ly}" width="14" height="12" fill="{fill}"/>"#);
        }
        let _ = writeln!(svg, r#"<text x="{}" y="{}">{name}</text>"#, lx + 20.0, ly + 11.0);
    }
    svg.push_str("</svg>\n");
    svg
}

/// Whether `python3` has torch with a CUDA device.
fn torch_available() -> bool {
    Command::new("python3")
        .args(["-c", "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs `command`, printing each line of its output that `show` maps to a message, and returns
/// every line; an error, with the output, when it fails.
fn stream(command: &mut Command, show: impl FnMut(&str) -> Option<String>) -> Result<Vec<String>> {
    let described = describe(command);
    let (lines, status) = stream_status(command, &described, show)?;
    if !status.success() {
        bail!("`{described}` failed ({status}); its output:\n{}", lines.join("\n"));
    }
    Ok(lines)
}

/// [`stream`], returning the lines and the exit status however it ended (the layer bench's
/// results up to a failure are kept); `described` names the command in errors.
fn stream_status(
    command: &mut Command,
    described: &str,
    mut show: impl FnMut(&str) -> Option<String>,
) -> Result<(Vec<String>, std::process::ExitStatus)> {
    let mut child = command.stdout(Stdio::piped()).spawn().with_context(|| format!("cannot start `{described}`"))?;
    let stdout = child.stdout.take().context("no stdout pipe")?;
    let mut lines = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.with_context(|| format!("reading the output of `{described}`"))?;
        if let Some(message) = show(&line) {
            println!("{message}");
        }
        lines.push(line);
    }
    let status = child.wait()?;
    Ok((lines, status))
}

/// Whether the bench runs across processes (launched as `rank` of `world` > 1), after checking
/// that the options fit that launch: `--ranks` only inside one process, tokens that split over
/// the processes, and no `engine` or `engine-gathering` backend over ranks.
fn check_launch(args: &BenchArgs, (rank, world): (usize, usize)) -> Result<bool> {
    let across = world > 1;
    if across && args.ranks > 1 {
        bail!(
            "launched as rank {rank} of {world}: the ranks are the processes here; --ranks P measures P virtual \
             ranks inside one process"
        );
    }
    if across {
        for &t in &args.tokens {
            if !t.is_multiple_of(world) {
                bail!("--tokens {t}: must split evenly over the {world} processes");
            }
        }
    }
    let one_gpu_only = |b: &&String| b.starts_with("engine") || without_gathering(b).1;
    if let Some(engine) = args.backends.iter().find(one_gpu_only).filter(|_| across || args.ranks > 1) {
        bail!(
            "--backends: over ranks the layer runs mma, megakernel[:N] or megakernels[:N] (no engine, no gathering), \
             not {engine}"
        );
    }
    Ok(across)
}

pub fn bench(root: &Path, args: &BenchArgs) -> Result<()> {
    // Under torchrun or srun with several processes the ranks are the processes: every process
    // runs the layer bench (which then runs one rank per GPU), rank 0 reports.
    let (rank, world) = launch_world(|name| std::env::var(name).ok())?;
    let across = check_launch(args, (rank, world))?;
    let cases = args.cases()?;
    fs::create_dir_all(&args.out).with_context(|| format!("cannot create {}", args.out.display()))?;
    if rank == 0 {
        // An earlier run's results must not pass for this one's, whatever happens below.
        for stale in ["results.json", "chart.svg", "layer.log"] {
            let _ = fs::remove_file(args.out.join(stale));
        }
    }
    let (layer, benches) = match &args.layer_bin {
        Some(bin) => {
            let folder = bin.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf);
            (bin.clone(), folder)
        }
        None => {
            println!("bench: building the layer benchmark (release)");
            (crate::bundle::build_bench(root, "layer")?, root.join("benches"))
        }
    };
    let mut ceilings: Option<(f64, f64)> = None;
    let mut baseline = None;
    if args.torch && !across && torch_available() {
        println!("bench: measuring the ceilings and the PyTorch layer ({cases})");
        let lines = stream(Command::new("python3").arg(benches.join("ceilings.py")), |l| {
            l.starts_with("CEILING").then(|| format!("  {l}"))
        })?;
        if let Some(line) = lines.iter().find(|l| l.starts_with("CEILING")) {
            let words: Vec<&str> = line.split_whitespace().collect();
            if let (Some(m), Some(c)) =
                (words.get(2).and_then(|w| w.parse().ok()), words.get(4).and_then(|w| w.parse().ok()))
            {
                ceilings = Some((m, c));
            }
        }
        let file = args.out.join("torch_baseline.txt");
        stream(
            Command::new("python3")
                .arg(benches.join("torch_moe.py"))
                .args(["--cases", &cases, "--reps", &args.reps.to_string(), "--out"])
                .arg(&file)
                .env("PYTHONUNBUFFERED", "1"),
            |l| Some(format!("  torch: {l}")),
        )?;
        baseline = Some(file);
    } else {
        println!(
            "bench: no PyTorch comparison ({})",
            if across {
                "the ranks are processes; the PyTorch layer runs on one GPU"
            } else if args.torch {
                "python3 with torch and CUDA not found"
            } else {
                "--no-torch"
            }
        );
    }
    let mut command = Command::new(&layer);
    command.args([
        "--cases",
        &cases,
        "--gemm",
        &args.backends.join(","),
        "--reps",
        &args.reps.to_string(),
        "--ranks",
        &args.ranks.to_string(),
    ]);
    if let Some(factor) = args.ring_factor {
        command.args(["--ring-factor", &factor.to_string()]);
    }
    if across && rank != 0 {
        // Rank 0 reports; this rank measures in step with it.
        let status = command.status().with_context(|| format!("cannot run {}", layer.display()))?;
        if !status.success() {
            bail!("rank {rank}: the layer bench failed ({status})");
        }
        return Ok(());
    }
    if let Some(file) = &baseline {
        command.arg("--baseline").arg(file);
    }
    if let Some((matmul, copy)) = ceilings {
        command.args(["--matmul-tflops", &matmul.to_string(), "--copy-tbps", &copy.to_string()]);
    }
    let total = args.runs();
    let mut done = 0;
    let described = describe(&command);
    let (lines, status) = stream_status(&mut command, &described, |line| {
        if let Some(m) = parse_result(line) {
            done += 1;
            let torch = m.get("torch_fwd_ms");
            let ratio =
                if torch.is_finite() { format!(" ({:.2}x PyTorch)", torch / m.get("fwd_ms")) } else { String::new() };
            Some(format!(
                "  [{done}/{total}] {} T={} {}: forward {:.2} ms{ratio}, forward + backward {:.2} ms",
                m.shape,
                m.tokens,
                m.backend,
                m.get("fwd_ms"),
                m.get("step_ms")
            ))
        } else if line.contains("no usable GPU") || line.starts_with("layer benchmark on") {
            Some(format!("  {line}"))
        } else {
            None
        }
    })?;
    fs::write(args.out.join("layer.log"), lines.join("\n") + "\n")?;
    let results: Vec<Measurement> = lines.iter().filter_map(|l| parse_result(l)).collect();
    if results.is_empty() {
        let why = if status.success() { "no usable GPU?" } else { "the layer bench failed" };
        bail!("nothing measured ({why}; `{described}` {status}): see {}", args.out.join("layer.log").display());
    }
    // The cases measured before a failure are kept, and said to be partial.
    fs::write(args.out.join("results.json"), to_json(ceilings, &results))?;
    fs::write(args.out.join("chart.svg"), to_svg(&results))?;
    if !status.success() {
        bail!(
            "`{described}` failed ({status}) after {} of {total} results, which {} holds; its output is in {}",
            results.len(),
            args.out.join("results.json").display(),
            args.out.join("layer.log").display()
        );
    }
    for line in lines.iter().filter(|l| l.starts_with('|')) {
        println!("{line}");
    }
    println!(
        "bench: {} results in {}, chart in {}",
        results.len(),
        args.out.join("results.json").display(),
        args.out.join("chart.svg").display()
    );
    Ok(())
}

/// `cargo xtask bench-chart`: results.json and chart.svg from a saved log's RESULT lines.
pub fn chart_from_log(log: &Path, out: &Path) -> Result<()> {
    let text = fs::read_to_string(log).with_context(|| format!("cannot read {}", log.display()))?;
    let results: Vec<Measurement> = text.lines().filter_map(parse_result).collect();
    if results.is_empty() {
        bail!("{} has no RESULT lines", log.display());
    }
    fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    fs::write(out.join("results.json"), to_json(None, &results))?;
    fs::write(out.join("chart.svg"), to_svg(&results))?;
    println!("bench-chart: {} results from {} into {}", results.len(), log.display(), out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> BenchArgs {
        BenchArgs {
            shapes: vec!["kimi".into(), "qwen".into()],
            tokens: vec![8192, 32768],
            backends: vec!["engine".into(), "megakernel:4".into()],
            ranks: 1,
            ring_factor: None,
            reps: 10,
            out: "x".into(),
            torch: true,
            layer_bin: None,
        }
    }

    #[test]
    fn options_become_cases_or_name_what_is_wrong() {
        assert_eq!(args().cases().unwrap(), "kimi:8192,kimi:32768,qwen:8192,qwen:32768");
        assert_eq!(args().runs(), 8);
        let bad = |edit: fn(&mut BenchArgs)| {
            let mut a = args();
            edit(&mut a);
            a.cases().unwrap_err().to_string()
        };
        assert!(bad(|a| a.shapes = vec!["llama".into()]).contains("unknown shape \"llama\""));
        assert!(bad(|a| a.backends = vec!["megakernel:x".into()]).contains("unknown backend"));
        assert!(bad(|a| a.backends = vec!["cublas".into()]).contains("unknown backend"));
        assert!(bad(|a| a.ring_factor = Some(2.0)).contains("give --ranks P too"));
        assert!(
            bad(|a| {
                a.ranks = 2;
                a.ring_factor = Some(0.5);
            })
            .contains("at least an even split")
        );
        assert!(bad(|a| a.backends = vec!["megakernels:".into()]).contains("unknown backend"));
        for wrong in ["megakernel:0/4", "megakernels:0/", "megakernels:0/4/8", "megakernels:/4"] {
            let mut a = args();
            a.backends = vec![wrong.into()];
            assert!(a.cases().unwrap_err().to_string().contains("unknown backend"), "{wrong}");
        }
        let mut both = args();
        both.backends = vec!["megakernels".into(), "megakernels:4".into(), "megakernels:0/4".into()];
        assert!(both.cases().is_ok());
        assert!(bad(|a| a.tokens = vec![]).contains("at least one value"));
        assert!(
            bad(|a| {
                a.ranks = 3;
            })
            .contains("split evenly over --ranks 3")
        );
        assert!(bad(|a| a.reps = 0).contains("at least 1"));
        // Every backend runs at P virtual ranks too.
        let mut ep = args();
        ep.ranks = 8;
        assert_eq!(ep.runs(), args().runs());
    }

    #[test]
    fn a_launch_across_processes_checks_its_options() {
        let mut a = args();
        a.backends = vec!["mma".into(), "megakernel".into()];
        assert!(!check_launch(&a, (0, 1)).unwrap(), "one process");
        assert!(check_launch(&a, (3, 8)).unwrap(), "eight processes");
        let mut virtual_ranks = a.clone();
        virtual_ranks.ranks = 8;
        assert!(check_launch(&virtual_ranks, (0, 8)).unwrap_err().to_string().contains("ranks are the processes"));
        assert!(!check_launch(&virtual_ranks, (0, 1)).unwrap());
        let mut uneven = a.clone();
        uneven.tokens = vec![8190];
        assert!(check_launch(&uneven, (0, 8)).unwrap_err().to_string().contains("split evenly over the 8"));
        let mut engine = a.clone();
        engine.backends = vec!["engine".into()];
        assert!(check_launch(&engine, (1, 4)).unwrap_err().to_string().contains("not engine"));
        engine.ranks = 2;
        assert!(check_launch(&engine, (0, 1)).unwrap_err().to_string().contains("not engine"));
        engine.ranks = 1;
        assert!(!check_launch(&engine, (0, 1)).unwrap(), "engine on one GPU");
        engine.backends = vec!["engine-gathering".into()];
        assert!(!check_launch(&engine, (0, 1)).unwrap(), "engine-gathering on one GPU");
        assert!(engine.cases().is_ok(), "engine-gathering is a known backend");
        assert!(check_launch(&engine, (1, 4)).unwrap_err().to_string().contains("not engine-gathering"));
        let mut gathering = a.clone();
        gathering.backends = vec!["megakernel-gathering".into(), "megakernels:4-gathering".into()];
        assert!(gathering.cases().is_ok(), "the megakernels gathering are known backends");
        assert!(!check_launch(&gathering, (0, 1)).unwrap(), "gathering on one GPU");
        assert!(check_launch(&gathering, (1, 4)).unwrap_err().to_string().contains("not megakernel-gathering"));
        gathering.ranks = 8;
        assert!(check_launch(&gathering, (0, 1)).unwrap_err().to_string().contains("not megakernel-gathering"));
        gathering.ranks = 1;
        gathering.backends = vec!["engine-gathering-forward".into(), "megakernel:2-gathering-forward".into()];
        assert!(gathering.cases().is_ok(), "the gate/up gathering alone is a known suffix");
        assert!(check_launch(&gathering, (1, 4)).unwrap_err().to_string().contains("not engine-gathering-forward"));
        for unknown in
            ["mma-gathering", "megakernel:x-gathering", "gathering", "mma-gathering-forward", "engine-forward"]
        {
            gathering.backends = vec![unknown.into()];
            assert!(gathering.cases().unwrap_err().to_string().contains("unknown backend"), "{unknown}");
        }
        let mut both = a.clone();
        both.backends = vec!["megakernels".into()];
        assert!(check_launch(&both, (0, 4)).unwrap(), "both megakernels across processes (one rank each)");
        both.ranks = 8;
        assert!(!check_launch(&both, (0, 1)).unwrap(), "both megakernels over virtual ranks");
    }

    #[test]
    fn the_launchers_variables_give_rank_and_world() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| pairs.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string())
        };
        assert_eq!(launch_world(env(&[])).unwrap(), (0, 1));
        assert_eq!(launch_world(env(&[("RANK", "3"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "3")])).unwrap(), (3, 8));
        let step = &[("SLURM_STEP_ID", "0"), ("SLURM_PROCID", "5"), ("SLURM_NTASKS", "72")];
        assert_eq!(launch_world(env(step)).unwrap(), (5, 72));
        let preserved =
            &[("SLURM_STEP_ID", "0"), ("SLURM_PROCID", "1"), ("SLURM_NTASKS", "72"), ("SLURM_STEP_NUM_TASKS", "8")];
        assert_eq!(launch_world(env(preserved)).unwrap(), (1, 8));
        // An sbatch script's batch step: one process.
        assert_eq!(launch_world(env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "72")])).unwrap(), (0, 1));
        // torchrun under Slurm: torchrun's own variables win.
        assert_eq!(
            launch_world(env(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")]))
                .unwrap(),
            (1, 2)
        );
        assert!(launch_world(env(&[("RANK", "1")])).unwrap_err().to_string().contains("WORLD_SIZE is unset"));
        assert!(
            launch_world(env(&[("RANK", "x"), ("WORLD_SIZE", "2")]))
                .unwrap_err()
                .to_string()
                .contains("not a non-negative integer")
        );
        assert!(
            launch_world(env(&[("RANK", "2"), ("WORLD_SIZE", "2")]))
                .unwrap_err()
                .to_string()
                .contains("below a positive world size")
        );
    }

    const LINES: &str = "\
layer benchmark on NVIDIA H200; backends engine, megakernel:0
RESULT kimi 8192 engine fwd_ms 15.570 step_ms 44.960 fwd_tflops 449.0 step_tflops 467.0 fwd_flop_floor_ms 8.930 fwd_byte_floor_ms 7.920 step_floor_ms 26.800 torch_fwd_ms 18.230 torch_step_ms 55.430 flops 6995000000000 launches 10
RESULT kimi 8192 megakernel:0 fwd_ms 16.510 step_ms 45.120 fwd_tflops 424.0 step_tflops 465.0 fwd_flop_floor_ms 8.930 fwd_byte_floor_ms 7.920 step_floor_ms 26.800 torch_fwd_ms 18.230 torch_step_ms 55.430 flops 6995000000000 launches 7
RESULT qwen 8192 engine fwd_ms 7.000 step_ms 18.690 fwd_tflops 357.0 step_tflops 401.0 fwd_flop_floor_ms 3.200 fwd_byte_floor_ms 3.030 step_floor_ms 9.600 torch_fwd_ms NaN torch_step_ms NaN flops 2500000000000 launches 10
| shape | T | backend |
";

    #[test]
    fn result_lines_become_json_and_a_chart() {
        let results: Vec<Measurement> = LINES.lines().filter_map(parse_result).collect();
        assert_eq!(results.len(), 3);
        assert_eq!(
            (results[1].shape.as_str(), results[1].tokens, results[1].backend.as_str()),
            ("kimi", 8192, "megakernel:0")
        );
        assert_eq!(results[1].get("fwd_ms"), 16.51);
        assert!(results[2].get("torch_fwd_ms").is_nan() && results[2].get("missing").is_nan());
        let json = to_json(Some((783.0, 4.23)), &results);
        let parsed = crate::json::parse(&json.replace('\n', " ")).expect("valid JSON");
        let first = &parsed.get("results").unwrap().as_array().unwrap()[0];
        assert_eq!(first.get("backend").unwrap().as_str(), Some("engine"));
        assert!(json.contains("\"torch_fwd_ms\": null"), "NaN must be null: {json}");
        let svg = to_svg(&results);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        // Bars: per panel kimi's engine, megakernel and PyTorch, qwen's engine (no baseline); then
        // three legend swatches.
        assert_eq!(svg.matches("<rect x=").count() - 3, 2 * 3 + 2, "{svg}");
        assert!(svg.contains("FLOP floor: ") && svg.contains("byte floor: "));
        assert!(svg.contains(">kimi<") && svg.contains(">T=8192<") && svg.contains(">megakernel:0<"));
        // Across processes neither PyTorch nor the floors are measured: neither is drawn or named.
        let bare: Vec<Measurement> = [
            "RESULT kimi 8192 procs8:megakernels fwd_ms 15.1 step_ms 45.2 flops 5770000000000",
            "RESULT qwen 8192 procs8:megakernels fwd_ms 7.1 step_ms 21.0 flops 2000000000000",
        ]
        .iter()
        .filter_map(|l| parse_result(l))
        .collect();
        assert_eq!(bare.len(), 2);
        let svg = to_svg(&bare);
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(!svg.contains("PyTorch") && !svg.contains("floors:") && !svg.contains("floor: "), "{svg}");
        // Per panel one bar per case, then one legend swatch.
        assert_eq!(svg.matches("<rect x=").count(), 2 * 2 + 1, "{svg}");
    }
}
