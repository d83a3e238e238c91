//! Runs the layering check (design.md section 3) on the real workspace: `cargo test -p xtask`
//! fails on a forbidden dependency edge or a forbidden name in offload-core's sources.

use xtask::layering;

#[test]
fn workspace_respects_the_layering_rules() {
    let report = layering::check_workspace(&xtask::workspace_root())
        .unwrap_or_else(|err| panic!("layering check could not run: {err}"));
    assert!(report.is_ok(), "{report}");
}

#[test]
fn check_sees_every_workspace_crate_and_the_core_sources() {
    let report = layering::check_workspace(&xtask::workspace_root())
        .unwrap_or_else(|err| panic!("layering check could not run: {err}"));
    for name in [layering::CORE, "tier-testkit", "connector", "xtask"] {
        assert!(
            layering::rule_for(name).is_some(),
            "{name} missing from the layering table"
        );
    }
    // offload-core, tier-testkit, three tiers, connector, engine-sim, xtask, kvtier-tests.
    assert!(report.crate_count >= 9, "{report}");
    assert!(report.edge_count > 0, "{report}");
    assert!(report.file_count > 0, "{report}");
}
