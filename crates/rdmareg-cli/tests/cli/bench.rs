//! `rdmareg bench` in miniature: a short sweep against the real
//! `ucx_perftest` must produce every output file with one row per
//! measurement and a ratio wherever a baseline ran. (Figures are not
//! asserted: speed is measured by the benchmark, not by tests.)

use std::process::Command;

#[test]
fn a_short_sweep_writes_tables_csv_json_and_svg_with_ratios() {
    let out = std::env::temp_dir().join(format!("rdmareg-bench-test-{}", std::process::id()));
    let output = Command::new(env!("CARGO_BIN_EXE_rdmareg"))
        .args([
            "bench",
            "--transport",
            "shm",
            "--sizes",
            "8,64K",
            "--scale",
            "0.01",
        ])
        .args([
            "--window",
            "4",
            "--pool-sizes",
            "4K,1M",
            "--perftest-port",
            "14470",
        ])
        .arg("--out")
        .arg(&out)
        .output()
        .expect("rdmareg runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");

    let csv = std::fs::read_to_string(out.join("results.csv")).unwrap();
    let rows: Vec<&str> = csv.lines().skip(1).collect();
    assert_eq!(rows.len(), 2, "{csv}");
    for row in &rows {
        let cells: Vec<&str> = row.split(',').collect();
        assert_eq!(cells[0], "shm");
        let bandwidth_ratio: f64 = cells[12].parse().expect("a bandwidth ratio");
        assert!(bandwidth_ratio > 0.0);
        let list_bandwidth: f64 = cells[10].parse().expect("a list bandwidth");
        assert!(list_bandwidth > 0.0);
        let list_ratio: f64 = cells[13].parse().expect("a list bandwidth ratio");
        assert!(list_ratio > 0.0);
        let latency_ratio: f64 = cells[8].parse().expect("a latency ratio");
        assert!(latency_ratio > 0.0);
    }
    let pool = std::fs::read_to_string(out.join("pool.csv")).unwrap();
    assert_eq!(pool.lines().count(), 3, "{pool}");
    let json = std::fs::read_to_string(out.join("results.json")).unwrap();
    assert!(json.contains("\"get\"") && json.contains("\"pool\""));
    let svg = std::fs::read_to_string(out.join("results.svg")).unwrap();
    assert_eq!(
        svg.matches("<polyline").count(),
        5,
        "latency: rdmareg and perftest; bandwidth: rdmareg, one list, perftest"
    );
    assert!(stdout.contains("list ratio"), "{stdout}");
    assert!(stdout.contains("bandwidth ratio"), "{stdout}");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_benchmark_owner_whose_consumer_vanishes_says_so_and_exits() {
    use std::io::{BufRead, BufReader, Read};
    use std::process::Stdio;

    let mut owner = Command::new(env!("CARGO_BIN_EXE_rdmareg"))
        .args([
            "bench-owner",
            "--transport",
            "tcp",
            "--size",
            "4K",
            "--listen",
            "127.0.0.1:0",
        ])
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("rdmareg runs");
    let mut lines = BufReader::new(owner.stdout.take().unwrap()).lines();
    let first = lines.next().expect("owner prints").expect("readable");
    let address = first
        .strip_prefix("owner listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
        .to_owned();
    let mut consumer = std::net::TcpStream::connect(&address).expect("connects");
    let mut prefix = [0u8; 4];
    consumer.read_exact(&mut prefix).expect("the offer arrives");
    drop(consumer);
    let output = owner.wait_with_output().expect("owner exits");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    // UCX's own log lines (e.g. about unused UCX_* variables) aside.
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.contains(" UCX ")).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].starts_with("rdmareg: lost the benchmark: its connection"),
        "{stderr}"
    );
}

#[test]
fn the_libfabric_lanes_run_beside_a_ucx_lane_in_one_sweep() {
    let out = std::env::temp_dir().join(format!("rdmareg-bench-ofi-{}", std::process::id()));
    let output = Command::new(env!("CARGO_BIN_EXE_rdmareg"))
        .args(["bench", "--transport", "tcp,ofi-tcp,ofi-shm"])
        .args(["--sizes", "8,64K", "--scale", "0.01", "--window", "4"])
        .args(["--pool-sizes", "4K", "--perftest-port", "14570"])
        .arg("--out")
        .arg(&out)
        .output()
        .expect("rdmareg runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");

    let csv = std::fs::read_to_string(out.join("results.csv")).unwrap();
    let rows: Vec<Vec<&str>> = csv
        .lines()
        .skip(1)
        .map(|r| r.split(',').collect())
        .collect();
    let lanes: Vec<&str> = rows.iter().map(|cells| cells[0]).collect();
    assert_eq!(
        lanes,
        ["tcp", "tcp", "ofi-tcp", "ofi-tcp", "ofi-shm", "ofi-shm"],
        "{csv}"
    );
    for cells in &rows {
        let latency: f64 = cells[5].parse().expect("a latency");
        let bandwidth: f64 = cells[9].parse().expect("a bandwidth");
        assert!(latency > 0.0 && bandwidth > 0.0, "{cells:?}");
        // ucx_perftest is the UCX lanes' baseline only.
        let perftest = cells[11];
        if cells[0].starts_with("ofi-") {
            assert_eq!(perftest, "", "{cells:?}");
        } else {
            assert!(perftest.parse::<f64>().is_ok(), "{cells:?}");
        }
    }
    assert!(stdout.contains("libfabric lanes"), "{stdout}");
    let _ = std::fs::remove_dir_all(&out);
}
