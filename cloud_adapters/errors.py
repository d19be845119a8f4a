"""Errors of the cloud adapters — the only exceptions that leave ``cloud_adapters/``.

Every SDK exception (botocore, azure-core, google-api-core, httpx) is translated into one of these
inside the provider module that caught it, chained with ``raise ... from e``. Each message names the
provider, the region and the operation, the field when a response was malformed, and a fix when one
is known. Nothing secret is ever put in a message: no keys, tokens or signed URLs.
"""

from __future__ import annotations

from xroute.errors import ConfigError, XrouteError

INSTALL_HINT = "pip install 'xroute[cloud]'"


class CloudError(XrouteError):
    """A cloud API call failed. ``retryable`` says whether a later attempt may succeed."""

    retryable = False

    def __init__(
        self,
        provider: str,
        problem: str,
        *,
        region: str | None = None,
        operation: str | None = None,
        field: str | None = None,
        hint: str | None = None,
    ):
        self.provider, self.problem, self.region = provider, problem, region
        self.operation, self.field, self.hint = operation, field, hint
        where = provider
        if region:
            where += f" {region}"
        if operation:
            where += f" {operation}"
        msg = f"{where}: {problem}"
        if field:
            msg += f" (field '{field}')"
        if hint:
            msg += f"; to fix: {hint}"
        super().__init__(msg)

    @property
    def reason(self) -> str:
        """A short reason for the collect log: the class of failure and the problem."""
        return f"{type(self).__name__}: {self.problem}" + (f" (field '{self.field}')" if self.field else "")


class CloudAuthError(CloudError):
    """Credentials are missing, expired or lack a permission. Not retried."""


class CloudThrottledError(CloudError):
    """The provider asked us to slow down (HTTP 429, ``Throttling``, ``RequestLimitExceeded``).

    ``retry_after`` is the provider's Retry-After in seconds, when it gave one.
    """

    retryable = True

    def __init__(self, provider: str, problem: str, *, retry_after: float | None = None, **kw):
        super().__init__(provider, problem, **kw)
        self.retry_after = retry_after


class CloudUnavailableError(CloudError):
    """A transient failure: HTTP 5xx, a timeout, a reset or truncated connection. Retried."""

    retryable = True


class CloudResponseError(CloudError):
    """A response could not be read or lacks a field we need (the message names the field). Not retried."""


class CloudNotSupportedError(CloudError):
    """The provider (or this adapter) cannot give this data; see the adapter's capability map."""


class SdkMissingError(CloudError):
    """The provider's SDK is not installed."""

    def __init__(self, provider: str, module: str):
        super().__init__(provider, f"the SDK module '{module}' is not installed", hint=INSTALL_HINT)
        self.module = module


class UnknownProviderError(ConfigError):
    """No adapter is registered under that name."""
