"""The demo's workload: FAQ topics of a fictional product, written for zerda-cache.

Each topic has a canonical question, paraphrases a user might type, the right answer and
a planted wrong answer (plausible, and wrong: the kind an LLM gets wrong and a cache
then repeats). ``OFF_TOPIC`` questions have no cached answer.
"""

from __future__ import annotations

from typing import NamedTuple


class Topic(NamedTuple):
    question: str
    paraphrases: tuple[str, ...]
    right: str
    wrong: str


TOPICS: tuple[Topic, ...] = (
    Topic(
        "How do I reset my password?",
        (
            "I forgot my password, how can I reset it?",
            "reset password steps",
            "How can I change a forgotten password?",
            "password reset how to",
        ),
        "Open Settings > Security and choose Reset password; a link arrives by email.",
        "Passwords cannot be reset; create a new account instead.",
    ),
    Topic(
        "How do I export my data?",
        (
            "export all my data",
            "How can I download my data as a file?",
            "data export instructions",
            "Can I export my account data?",
        ),
        "Go to Settings > Data and press Export; you get a ZIP of CSV files.",
        "Data export is only available through the mobile app.",
    ),
    Topic(
        "What are the support hours?",
        (
            "When is customer support open?",
            "support opening hours",
            "What time can I reach support?",
            "hours of the help desk",
        ),
        "Support answers Monday to Friday, 08:00 to 20:00 CET.",
        "Support is open 24 hours a day, every day.",
    ),
    Topic(
        "How do I cancel my subscription?",
        (
            "cancel subscription",
            "How can I stop my subscription?",
            "I want to end my plan, how?",
            "steps to cancel my plan",
        ),
        "In Billing, choose Cancel plan; it stays active until the period ends.",
        "Email the CEO to cancel; cancellations take 90 days.",
    ),
    Topic(
        "Which payment methods do you accept?",
        (
            "What payment options are there?",
            "can I pay by card or invoice",
            "accepted payment methods",
            "How can I pay for the service?",
        ),
        "Credit card, SEPA direct debit and, on yearly plans, invoice.",
        "Only cryptocurrency payments are accepted.",
    ),
    Topic(
        "How do I enable two-factor authentication?",
        (
            "turn on 2FA",
            "How can I set up two factor login?",
            "enable two-factor auth",
            "activate 2-step verification",
        ),
        "Settings > Security > Two-factor: scan the QR code with an authenticator app.",
        "Two-factor authentication is enabled by sending us your password.",
    ),
    Topic(
        "Can I change my username?",
        (
            "how to rename my account",
            "change user name",
            "Is it possible to edit my username?",
            "update my handle",
        ),
        "Yes, once every 30 days under Profile > Username.",
        "Usernames can never be changed.",
    ),
    Topic(
        "How do I delete my account?",
        (
            "remove my account permanently",
            "close my account",
            "How can I delete my profile?",
            "account deletion steps",
        ),
        "Settings > Account > Delete account; data is erased within 30 days.",
        "Accounts are deleted automatically after one day of inactivity.",
    ),
    Topic(
        "Where can I find my invoices?",
        (
            "download invoices",
            "Where are my bills?",
            "How do I get a receipt for my payment?",
            "invoice history location",
        ),
        "Billing > Invoices lists every invoice as a PDF.",
        "Invoices are only sent by post.",
    ),
    Topic(
        "Is there a free trial?",
        (
            "Can I try it for free?",
            "free trial length",
            "do you offer a trial period",
            "How long is the trial?",
        ),
        "Yes, 14 days with every feature, no card needed.",
        "There is a one-hour trial after entering a card.",
    ),
    Topic(
        "How do I invite a team member?",
        (
            "add a colleague to my team",
            "invite users to workspace",
            "How can I add people to my account?",
            "team invitation steps",
        ),
        "Team > Invite: enter their email; they join when they accept.",
        "Share your password with them so they can log in.",
    ),
    Topic(
        "What is the API rate limit?",
        (
            "API request limit",
            "How many API calls can I make?",
            "rate limits of the API",
            "max requests per minute API",
        ),
        "600 requests per minute per token; responses carry the remaining quota.",
        "The API has no limits at all.",
    ),
    Topic(
        "How do I generate an API key?",
        (
            "create API token",
            "Where do I get an API key?",
            "new API key steps",
            "how to make an access token",
        ),
        "Settings > Developer > New token; copy it once, it is not shown again.",
        "API keys are generated by support on request, within two weeks.",
    ),
    Topic(
        "Does the app work offline?",
        (
            "offline mode",
            "Can I use it without internet?",
            "does it work with no connection",
            "offline support",
        ),
        "The desktop app works offline and syncs when you reconnect.",
        "Nothing works offline, not even opening the app.",
    ),
    Topic(
        "How do I change the language?",
        (
            "switch interface language",
            "set the app to Turkish",
            "change display language",
            "How can I use another language?",
        ),
        "Profile > Preferences > Language; English, Turkish and German are available.",
        "The language follows your IP address and cannot be changed.",
    ),
    Topic(
        "What happens when my plan expires?",
        (
            "plan expiry",
            "What if my subscription runs out?",
            "after subscription ends what happens",
            "expired plan consequences",
        ),
        "The workspace becomes read-only for 60 days, then data is archived.",
        "All data is deleted the moment the plan expires.",
    ),
    Topic(
        "How do I connect Slack?",
        (
            "Slack integration setup",
            "link Slack to my workspace",
            "How can I get notifications in Slack?",
            "integrate with Slack",
        ),
        "Integrations > Slack > Connect, then pick the channels to notify.",
        "Slack cannot be connected; use fax notifications.",
    ),
    Topic(
        "Where are your servers located?",
        (
            "data center location",
            "Where is my data stored?",
            "which region hosts the data",
            "server location EU?",
        ),
        "In Frankfurt and Amsterdam; data stays in the EU.",
        "Data is stored on a single laptop in our office.",
    ),
    Topic(
        "How do I restore a deleted file?",
        (
            "recover deleted file",
            "undo file deletion",
            "How can I get back a file I removed?",
            "restore from trash",
        ),
        "Open Trash, select the file, press Restore; files stay 30 days.",
        "Deleted files are gone immediately and cannot be restored.",
    ),
    Topic(
        "Can I get a refund?",
        (
            "refund policy",
            "How do I ask for my money back?",
            "is a refund possible",
            "request a refund",
        ),
        "Yes, within 14 days of a payment, from Billing > Request refund.",
        "Refunds are never given under any circumstances.",
    ),
)

OFF_TOPIC: tuple[str, ...] = (
    "What is the capital of Mongolia?",
    "Recommend a good pasta recipe",
    "How tall is Mount Ararat?",
    "Write a haiku about autumn",
    "Who won the 1998 world cup?",
    "translate good morning into Japanese",
)
