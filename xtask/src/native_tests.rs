//! The list in [`super::NATIVE`] checked against the workspace's real
//! dependency graph, so a new `-sys` crate or gRPC build cannot arrive
//! without a provisioner.

use std::collections::HashMap;
use std::fs;
use std::path::PathBuf;

use serde_json::Value;

use super::*;

/// `links` keys that name no library a build must find, with the reason.
/// Each reason is checked where it can be (see `exemptions_still_hold`).
const EXEMPT_LINKS: &[(&str, &str)] = &[
    (
        "clang",
        "clang-sys is built with `runtime`: libclang is loaded when bindgen runs, and `cargo xtask bindgen` provisions it",
    ),
    (
        "prettyplease02",
        "no native library: the key passes metadata between prettyplease versions",
    ),
    (
        "prettyplease03",
        "no native library: the key passes metadata between prettyplease versions",
    ),
];

/// What a workspace build script does when it probes for a native library.
const PROBE_MARKERS: &[&str] = &[
    "rustc-link-lib",
    "pkg_config::",
    "pkg-config",
    "cc::Build",
    "cmake::",
    "bindgen::",
];

/// A package of the resolved graph, as far as the check needs it.
#[derive(Debug, Clone, Default)]
struct Package {
    name: String,
    workspace_member: bool,
    links: Option<String>,
    /// The text of its build script, for workspace members that have one.
    build_script: Option<String>,
    /// Names of the packages it depends on at build time (resolved, so
    /// optional dependencies that are off are not here).
    build_dependencies: Vec<String>,
    features: Vec<String>,
}

/// The needs `package` has that no entry of `natives` in `build` meets.
fn unprovisioned(packages: &[Package], natives: &[Native], build: &[Need]) -> Vec<String> {
    let provided_in_build = |covers: &dyn Fn(&Native) -> bool| {
        natives
            .iter()
            .any(|native| covers(native) && build.contains(&native.need))
    };
    let mut problems = Vec::new();
    for package in packages {
        if let Some(key) = &package.links {
            let exempt = EXEMPT_LINKS.iter().any(|(name, _)| name == key);
            if !exempt && !provided_in_build(&|native| native.links.contains(&key.as_str())) {
                problems.push(format!(
                    "{} has `links = \"{key}\"` but no entry of xtask's native list in BUILD provisions it",
                    package.name
                ));
            }
        }
        if package.workspace_member
            && let Some(script) = &package.build_script
            && let Some(marker) = PROBE_MARKERS.iter().find(|m| script.contains(*m))
            && !provided_in_build(&|native| native.probed_by.contains(&package.name.as_str()))
        {
            problems.push(format!(
                "{}'s build script probes a native library (`{marker}`) but no entry of xtask's native list in BUILD names it in `probed_by`",
                package.name
            ));
        }
        for tool in &package.build_dependencies {
            let runs_something = natives
                .iter()
                .any(|native| native.run_by_build_crates.contains(&tool.as_str()));
            if runs_something
                && !provided_in_build(&|native| native.run_by_build_crates.contains(&tool.as_str()))
            {
                problems.push(format!(
                    "{} builds with {tool}, whose program no entry in BUILD provisions",
                    package.name
                ));
            }
        }
    }
    problems
}

/// The resolved dependency graph of the workspace on this platform.
fn workspace_packages() -> Vec<Package> {
    let output = cargo([
        "metadata",
        "--format-version",
        "1",
        "--locked",
        "--filter-platform",
        "x86_64-unknown-linux-gnu",
    ])
    .output()
    .expect("cargo metadata runs");
    assert!(
        output.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metadata: Value = serde_json::from_slice(&output.stdout).expect("metadata is JSON");
    let members: Vec<&str> = metadata["workspace_members"]
        .as_array()
        .expect("workspace_members")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let by_id: HashMap<&str, &Value> = metadata["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .map(|package| (package["id"].as_str().unwrap_or_default(), package))
        .collect();
    let name_of = |id: &str| by_id[id]["name"].as_str().unwrap_or_default().to_owned();
    metadata["resolve"]["nodes"]
        .as_array()
        .expect("resolve.nodes")
        .iter()
        .map(|node| {
            let id = node["id"].as_str().unwrap_or_default();
            let package = by_id[id];
            let workspace_member = members.contains(&id);
            let build_script = package["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|target| {
                    target["kind"]
                        .as_array()
                        .is_some_and(|kinds| kinds.iter().any(|k| k == "custom-build"))
                })
                .and_then(|target| target["src_path"].as_str())
                .filter(|_| workspace_member)
                .map(|path| fs::read_to_string(PathBuf::from(path)).expect("build script reads"));
            let build_dependencies = node["deps"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|dep| {
                    dep["dep_kinds"]
                        .as_array()
                        .is_some_and(|kinds| kinds.iter().any(|k| k["kind"] == "build"))
                })
                .map(|dep| name_of(dep["pkg"].as_str().unwrap_or_default()))
                .collect();
            Package {
                name: name_of(id),
                workspace_member,
                links: package["links"].as_str().map(str::to_owned),
                build_script,
                build_dependencies,
                features: node["features"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|f| f.as_str().map(str::to_owned))
                    .collect(),
            }
        })
        .collect()
}

/// The story: a `-sys` crate, a build script that finds a library with
/// pkg-config, or a dependency generating gRPC code, each needs something
/// Cargo does not fetch; `cargo xtask demo` on a fresh machine failed once
/// because one of them was provisioned only by `ci`. Every such need in
/// today's graph has an entry, and that entry is in `BUILD`, which every
/// building task provisions.
#[test]
fn every_native_need_of_the_graph_is_provisioned() {
    let problems = unprovisioned(&workspace_packages(), NATIVE, BUILD);
    assert!(problems.is_empty(), "{problems:#?}");
}

/// The exemptions are facts about the graph, not wishes: clang-sys is
/// resolved with `runtime` (so its build finds no libclang).
#[test]
fn exemptions_still_hold() {
    let packages = workspace_packages();
    for clang in packages.iter().filter(|p| p.name == "clang-sys") {
        assert!(
            clang.features.iter().any(|f| f == "runtime"),
            "clang-sys is resolved without `runtime`: libclang is then needed at build time and must join BUILD ({:?})",
            clang.features
        );
    }
}

#[test]
fn a_links_key_without_a_provisioner_is_reported() {
    let dummy = Package {
        name: "dummy-sys".to_owned(),
        workspace_member: true,
        links: Some("foo".to_owned()),
        ..Package::default()
    };
    let problems = unprovisioned(&[dummy], NATIVE, BUILD);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].contains("links = \"foo\""), "{problems:?}");
}

#[test]
fn a_build_script_probing_a_library_is_reported() {
    let probing = Package {
        name: "rdmareg-new-sys".to_owned(),
        workspace_member: true,
        build_script: Some("fn main() { pkg_config::probe_library(\"bar\").unwrap(); }".into()),
        ..Package::default()
    };
    let problems = unprovisioned(&[probing], NATIVE, BUILD);
    assert_eq!(problems.len(), 1, "{problems:?}");
}

#[test]
fn a_provisioner_left_out_of_build_is_reported() {
    let ucx_sys = Package {
        name: "rdmareg-ucx-sys".to_owned(),
        workspace_member: true,
        links: Some("ucp".to_owned()),
        ..Package::default()
    };
    let grpc = Package {
        name: "etcd-client".to_owned(),
        build_dependencies: vec!["tonic-build".to_owned()],
        ..Package::default()
    };
    let without = [Need::Libfabric];
    let problems = unprovisioned(&[ucx_sys, grpc], NATIVE, &without);
    assert_eq!(problems.len(), 2, "{problems:?}");
}

#[test]
fn every_need_has_exactly_one_entry() {
    let needs = [
        Need::Ucx,
        Need::Libfabric,
        Need::Protoc,
        Need::UcxBuildTools,
        Need::Etcd,
        Need::Libclang,
        Need::Iproute2,
        Need::Nextest,
        Need::CargoFuzz,
        Need::Nixl,
        Need::Debootstrap,
    ];
    assert_eq!(needs.len(), NATIVE.len());
    for need in needs {
        assert_eq!(
            NATIVE.iter().filter(|native| native.need == need).count(),
            1,
            "{need:?}"
        );
    }
}
