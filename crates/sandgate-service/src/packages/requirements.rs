//! Which requirements `install_packages` takes, and the pip command line that installs them.
//!
//! A requirement is a PEP 508 dependency specifier ([pep508_rs] parses it) limited to what pip
//! resolves by name against the tenant's index: a project name, optional `[extras]` and version
//! specifiers. URLs, paths, environment markers and pip options are refused before anything
//! reaches the sandbox, and each accepted requirement is shell-quoted.
//!
//! <https://peps.python.org/pep-0508/>

use std::str::FromStr;

use pep508_rs::{Requirement, VersionOrUrl};

/// Most packages one call installs.
pub const MAX_PACKAGES: usize = 50;
/// Longest requirement accepted (a name with extras and version specifiers).
pub const MAX_REQUIREMENT: usize = 200;

/// Why a list of requirements was refused (the text says what is taken instead).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequirementError {
    /// None, or more than [`MAX_PACKAGES`].
    #[error(
        "packages: give between 1 and {MAX_PACKAGES} requirements, e.g. [\"requests\", \"polars>=1.0\"]"
    )]
    Count,
    /// One that pip would not resolve by name from the index.
    #[error(
        "packages: {0:?} is not a requirement pip takes by name (a project name, optionally with \
         [extras] and version specifiers such as >=1.0; no URLs, paths or options)"
    )]
    NotByName(String),
}

/// `pip install --progress-bar off 'req' …`, each requirement checked and shell-quoted.
pub fn pip_command(packages: &[String]) -> Result<String, RequirementError> {
    if packages.is_empty() || packages.len() > MAX_PACKAGES {
        return Err(RequirementError::Count);
    }
    let mut command = String::from("pip install --progress-bar off");
    for req in packages {
        let req = req.trim();
        if !by_name(req) {
            return Err(RequirementError::NotByName(req.to_owned()));
        }
        command.push_str(" '");
        command.push_str(req);
        command.push('\'');
    }
    Ok(command)
}

/// Whether `req` is a PEP 508 requirement by name: no URL, no marker, nothing that would need
/// more than single quotes in a shell.
fn by_name(req: &str) -> bool {
    if req.is_empty() || req.len() > MAX_REQUIREMENT || req.contains(['\'', '\\', '\n']) {
        return false;
    }
    let Ok(parsed) = Requirement::<pep508_rs::VerbatimUrl>::from_str(req) else {
        return false;
    };
    let by_version = match &parsed.version_or_url {
        None | Some(VersionOrUrl::VersionSpecifier(_)) => true,
        Some(VersionOrUrl::Url(_)) => false,
    };
    by_version && parsed.marker.is_true()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requirements_are_quoted_and_anything_else_is_refused() {
        let ok = pip_command(&["pandas>=2".into(), "pydantic[email]==2.9".into()]).unwrap();
        assert_eq!(
            ok,
            "pip install --progress-bar off 'pandas>=2' 'pydantic[email]==2.9'"
        );
        for bad in [
            "--index-url=http://x",
            "x; rm -rf ~",
            "x'y",
            "/home/user/a.whl",
            "",
            "a$(id)",
            "pkg @ https://example.com/pkg.whl",
            "pkg; python_version > '3'",
            "pkg>=1 --extra-index-url http://x",
        ] {
            assert!(
                pip_command(&[bad.into()]).is_err(),
                "{bad:?} must be refused"
            );
        }
        assert_eq!(pip_command(&[]), Err(RequirementError::Count));
    }

    #[test]
    fn what_pip_takes_by_name_is_accepted() {
        for good in [
            "requests-toolbelt",
            "polars>=1.0",
            "pydantic[email]==2.9.2",
            "numpy ~= 2.1",
            "scipy!=1.0,<2",
            "Django==5.*",
        ] {
            assert!(pip_command(&[good.into()]).is_ok(), "{good:?} is taken");
        }
    }
}
